"""The torchtitan-ckpt command on real checkpoints, and the generated config reference."""

from __future__ import annotations

import os
import shutil

from torchtitan_ckpt import cli, commit, docgen, layout

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
    assert "complete, step 4, saved by 1 rank(s)" in out
    assert "tok_embeddings.weight" in out and "bfloat16" in out and "[256, 64]" in out

    assert cli.main(["inspect", layout.step_dir(folder, 2)]) == 0
    out = capsys.readouterr().out
    for section in ("[model]", "[optimizer]", "[lr_scheduler]", "[dataloader]", "[train_state]"):
        assert section in out
    assert "optimizer.state.output.weight.exp_avg" in out


def test_cli_errors_name_the_path(tmp_path, capsys):
    assert cli.main(["list", str(tmp_path / "nope")]) == 2
    assert "nope is not a folder" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert "no .metadata" in capsys.readouterr().err


def test_config_reference_is_fresh():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == docgen.render(docgen.load_root(EXAMPLE_ROOT), EXAMPLE_ROOT), "docs/config.md is stale: run `make docs`"
