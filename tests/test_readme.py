"""README.md stays true to the code: every flag is documented, CI runs its test command, the
worked example of your own model and images runs and prints what README shows, and every
link to docs/ leads somewhere."""

import re
import shlex

from conftest import REPO, python_cmd, read_metrics, run
from flags import build_parser

README = (REPO / "README.md").read_text()


def section(title):
    start = README.index(f"\n## {title}\n")
    return README[start:README.index("\n## ", start + 1)]


def test_every_flag_is_in_the_readme_table():
    table = section("Flags")
    flags = {option for action in build_parser("x")._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    missing = {flag for flag in flags if not re.search(rf"`{flag}[ `]", table)}
    assert not missing, f"flags missing from README's table: {sorted(missing)}"


def test_ci_runs_the_readme_test_command():
    command = re.search(r"## Tests\n\n```bash\n(.+)\n```", README).group(1)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


def test_the_worked_example_runs_and_prints_what_the_readme_shows(tmp_path):
    example = section("Your own model and your own images")
    (tmp_path / "my_net.py").write_text(re.search(r"```python\n(.*?)```", example, re.S).group(1))
    commands = [shlex.split(line.split("#")[0]) for line in
                re.search(r"```bash\n(.*?)```", example, re.S).group(1).splitlines()]
    write_demo, train = commands[0], commands[1]
    assert write_demo[:2] == ["python", "dataset_utils.py"] and train[:2] == ["python", "train.py"]
    assert run(python_cmd(*write_demo[1:]), cwd=tmp_path).returncode == 0
    result = run(python_cmd(*train[1:], "--cache-dir", "cache", "--metrics-file", "m.jsonl"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = re.search(r"```\n(Decoding .*?)```", example, re.S).group(1)
    printed = result.stdout.replace(str(tmp_path) + "/", "")
    for line in shown.splitlines():  # the same lines, but for times, the device and the cache's hash
        line = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", "", line)
        if not line.startswith(("Device:", "Loader:", "Cache:", "Decod")):
            assert line in printed, line
    claimed = float(re.search(r"with a test accuracy of (\d\.\d+)", example).group(1))
    assert abs(read_metrics(tmp_path / "m.jsonl")[-1]["val_accuracy"] - claimed) <= 0.05


def test_every_link_to_a_file_leads_to_one():
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"
