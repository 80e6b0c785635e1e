"""README.md stays true to the code: every flag is documented, CI runs its test command, the
worked example of your own model and images runs and prints what README shows, and every
link to docs/ leads somewhere."""

import re
import shlex
import sys

import torch
import torchvision

import check_network
import dataset_utils
import predict
import recipe
from conftest import REPO, python_cmd, read_metrics, run
from tools import benchmark, demo_data, report
from train_utils import build_parser

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
    assert write_demo[:2] == ["python", "tools/demo_data.py"] and train[:2] == ["python", "train.py"]
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


def shell_blocks(markdown):
    """The text of each fenced block marked bash or sh, or not marked."""
    blocks, language, lines = [], None, []
    for line in markdown.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                if language in ("", "bash", "sh"):
                    blocks.append("\n".join(lines))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def documented_commands():
    """(page, script, its arguments) of every python, torchrun or tools/torchrun.py command in
    README's and docs/'s shell blocks (continuation lines joined; comments, shell variables
    and pipes dropped)."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in shell_blocks(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split(" #")[0].split("&&")[-1].split(" | ")[0]
                words = command.split()
                scripts = [i for i, word in enumerate(words) if re.fullmatch(r"(tools/)?\w+\.py", word)]
                if len(scripts) > 1 and words[scripts[0]] == "tools/torchrun.py":  # torchrun, as the job scripts run it
                    words[scripts[0]], scripts = "torchrun", scripts[1:]
                launchers = {word.rpartition("/")[2] for word in words[:scripts[0]]} if scripts else set()
                if launchers & {"python", "torchrun"}:
                    args = [word.strip("'\"") for word in words[scripts[0] + 1:] if "$" not in word]
                    yield page.name, words[scripts[0]], args


def test_every_documented_command_names_a_script_that_takes_its_flags(capsys, monkeypatch):
    """README and docs/ show commands users copy: each script must exist and parse the
    command's flags (placeholders such as DIR or W.pt are values, which parse). The optimizer
    and augmentation docs/recipe.md adds to recipe.py are added first, as the page says."""
    added = {**vars(recipe), "OPTIMIZERS": {}, "AUGMENTATIONS": {}}
    for snippet in re.findall(r"```python\n(.*?)```", (REPO / "docs" / "recipe.md").read_text(), re.S):
        exec(snippet, added)
    for table in ("OPTIMIZERS", "AUGMENTATIONS"):
        for name, value in added[table].items():
            monkeypatch.setitem(getattr(recipe, table), name, value)
    parsers = {"train.py": build_parser, "train_ddp.py": build_parser, "check_network.py": check_network.build_parser,
               "dataset_utils.py": dataset_utils.build_parser, "tools/benchmark.py": benchmark.build_parser,
               "tools/report.py": report.build_parser, "tools/demo_data.py": demo_data.build_parser,
               "predict.py": predict.build_parser}
    seen = set()
    for page, script, args in documented_commands():
        assert (REPO / script).is_file(), f"{page}: {script} does not exist"
        assert script in parsers, f"{page}: no parser known for {script}"
        parser = parsers[script]("x") if parsers[script] is build_parser else parsers[script]()
        try:
            parser.parse_args(args)
        except SystemExit:
            raise AssertionError(f"{page}: {script} {' '.join(args)}: {capsys.readouterr().err}") from None
        seen.add(script)
    assert {"train.py", "train_ddp.py", "tools/benchmark.py", "tools/demo_data.py", "check_network.py"} <= seen


def test_the_photos_walk_runs_as_written_and_the_weights_classify_in_plain_pytorch(tmp_path):
    """docs/photos.md's commands, in order, on the demo photos with a smaller image size and
    fewer steps (and random stand-in ImageNet weights: no internet here); then README's lines
    load the saved weights in a fresh Python and classify a photo with torchvision's
    transforms exactly as predict.py did."""
    page = (REPO / "docs" / "photos.md").read_text()
    block = re.search(r"## 3\. Train, predict\n\n```bash\n(.*?)```", page, re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines()]
    assert [c[1] for c in commands] == ["tools/demo_data.py", "train.py", "predict.py", "predict.py"]
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pt")
    faster = {"train.py": ["--image-size", "72", "--epochs", "1", "--limit-batches", "2", "--cache-dir", "cache",
                           "--metrics-file", "m.jsonl"]}
    results = []
    for command in commands:
        results.append(run(python_cmd(*command[1:], *faster.get(command[1], [])), cwd=tmp_path))
        assert results[-1].returncode == 0, f"{command}: {results[-1].stderr}"
        assert "Traceback" not in results[-1].stderr
    rows = (tmp_path / "predictions.csv").read_text().splitlines()
    assert rows[0] == "path,prediction,probability,top_k" and len(rows) == 1 + 61  # every demo photo
    held_out = (tmp_path / "held_out.csv").read_text().splitlines()
    assert held_out[0] == "path,label,prediction,probability,top_k" and len(held_out) == 1 + 12
    accuracy = read_metrics(tmp_path / "m.jsonl")[-1]["val_accuracy"]
    assert f"Accuracy: {accuracy:.4f} (" in results[-1].stdout

    snippet = re.search(r"```python\n(import torch, torchvision\n.*?)```", README, re.S).group(1)
    classified = run([sys.executable, "-c", snippet], cwd=tmp_path)
    assert classified.returncode == 0, classified.stderr
    photo = re.search(r'Image\.open\("(.*?)"\)', snippet).group(1)
    [row] = [row.split(",") for row in rows if row.startswith(f"{photo},")]
    name, probability = classified.stdout.strip().rsplit(" ", 1)  # a class name may have spaces
    assert name == row[1] and abs(float(probability) - float(row[2])) <= 2e-6, (classified.stdout, row)
