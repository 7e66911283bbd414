"""The torchtitan-ckpt command on real checkpoints, and the generated config reference."""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed.checkpoint as dcp

from torchtitan_ckpt import Checkpoint, CheckpointManager, apidoc, cli, commit, docgen, layout

EXAMPLE_ROOT = "torchtitan_ckpt.example.config:JobConfig"

from .helpers import ROOT
from .jobs import make_job


def test_list_and_inspect(tmp_path, capsys):
    job = make_job(str(tmp_path), steps=4, interval=2, export_dtype="bfloat16")
    job.run_to(4, steps=4)
    job.manager.close()
    folder = os.path.join(tmp_path, "checkpoint")
    shutil.copytree(layout.step_dir(folder, 2), layout.step_dir(folder, 3))
    commit.uncommit(layout.step_dir(folder, 3))  # as a save of ours that crashed leaves it

    assert cli.main(["list", folder]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("2", "complete"), ("3", "partial"), ("4", "complete")]
    assert rows[0][-5:] == ["model,", "optimizer,", "lr_scheduler,", "dataloader,", "train_state"]
    assert rows[2][-1] == "model"

    assert cli.main(["inspect", layout.step_dir(folder, 4)]) == 0
    out = capsys.readouterr().out
    assert "complete, step 4, saved by 1 rank" in out
    assert "tok_embeddings.weight" in out and "bfloat16" in out and "[256, 64]" in out

    assert cli.main(["inspect", layout.step_dir(folder, 2)]) == 0
    out = capsys.readouterr().out
    for section in ("[model]", "[optimizer]", "[lr_scheduler]", "[dataloader]", "[train_state]"):
        assert section in out
    assert "optimizer.state.output.weight.exp_avg" in out


def test_cli_errors_name_the_path(tmp_path, capsys):
    assert cli.main(["list", str(tmp_path / "nope")]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: {tmp_path} holds no checkpoint: no .metadata (DCP), no model.safetensors.index.json or "
        "model.safetensors (Hugging Face); name a step folder\n")
    with CheckpointManager(Checkpoint(enable=True, interval=1), [torch.nn.Linear(2, 2)], base_folder=str(tmp_path)) as m:
        m.save(1)
        m.save(2)
    ckpt = str(tmp_path / "checkpoint")
    assert cli.main(["inspect", ckpt]) == 2  # a folder of steps named for a step: which ones it holds
    assert capsys.readouterr().err.endswith(": it holds the step folders step-1 to step-2; name one of them\n")
    assert cli.main(["clean", layout.step_dir(ckpt, 2)]) == 2  # and the other way round
    assert capsys.readouterr().err.endswith(f"error: {layout.step_dir(ckpt, 2)} is the step folder "
                                            f"{layout.step_dir(ckpt, 2)}: clean works on the folder holding the "
                                            f"step-N folders ({ckpt})\n")


def test_inspect_refuses_a_format_it_does_not_know(tmp_path, capsys):
    """A commit marker naming another format is an error naming it, not a guess at DCP."""
    step = layout.step_dir(str(tmp_path), 1)
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=step)
    commit.write_marker(step, commit.CommitInfo(step=1, states=["model"], format="zarr"))
    assert cli.main(["inspect", step]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: {step}: its COMMITTED.json names the format 'zarr'; inspect reads dcp, hf\n")


def _cli_md_section(title: str) -> str:
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        return f.read().split(f"### `{title}`", 1)[1].split("\n### ", 1)[0]


def test_cli_md_documents_what_list_prints(tmp_path, capsys):
    """docs/cli.md's `list --json` example has the keys the command prints, and its status table
    names every status `list` gives a step."""
    section = _cli_md_section("list --json DIR")
    example = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    step = layout.step_dir(str(tmp_path), 1)
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=step)
    commit.write_marker(step, commit.CommitInfo(step=1, states=["model"]))
    assert cli.main(["list", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(example) == list(printed)
    assert {tuple(s) for s in example["steps"]} == {tuple(printed["steps"][0])}
    assert re.findall(r"^\| `(\w+)` \|", section, re.M) == [
        layout.COMPLETE, layout.PARTIAL, cli.EMPTY, cli.CORRUPT, cli.NEWER, cli.OLDER, cli.MISNAMED, cli.CUT_SHORT,
        layout.FOREIGN, layout.UNKNOWN, layout.DENIED]


def test_config_reference_is_fresh():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == docgen.render(docgen.load_root(EXAMPLE_ROOT), EXAMPLE_ROOT), "docs/config.md is stale: run `make docs`"


def test_api_reference_is_fresh():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        assert f.read() == apidoc.render(apidoc.PACKAGES), "docs/api.md is stale: run `make docs`"


def test_every_option_is_in_the_docs():
    """Every option of every command is named in docs/cli.md."""
    with open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8") as f:
        text = f.read()
    commands = next(a for a in cli.build_parser()._actions if a.choices and a.dest == "command").choices
    missing = [f"{name} {option}" for name, parser in commands.items() for action in parser._actions
               for option in action.option_strings
               if option.startswith("--") and option != "--help" and not re.search(rf"[`/]{option}(?![\w-])", text)]
    assert not missing
