"""README.md stays true to the code: every flag is documented, and CI runs its test command."""

import re

from conftest import REPO
from train_utils import build_parser


def test_every_flag_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Flags"):readme.index("### The guide's recipes")]
    flags = {option for action in build_parser("x")._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    missing = {flag for flag in flags if not re.search(rf"`{flag}[ `]", table)}
    assert not missing, f"flags missing from README's table: {sorted(missing)}"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"## Tests\n\n```bash\n(.+)\n```", readme).group(1)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
