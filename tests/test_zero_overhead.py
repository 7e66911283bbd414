"""Staging in the background: `save()` returns before the copy, and what would change the staged
state (the optimizer's step, a forward pass's buffers, any other state) never reaches the
checkpoint; `verify_staging` catches what the optimizer's hook cannot see."""

from __future__ import annotations

import os
import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_ckpt import CheckpointManager, ConfigError, StagingMismatchError, layout, step_hooks
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.io.stagers import FreshCopies, SharedArenas
from torchtitan_ckpt.staging import BackgroundSaves, SaveJob, make_strategy

from .helpers import TensorState, assert_same, read_checkpoint, spawn

MODES = ["async", "async_with_pinned_mem"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _snapshot(model, opt, counter) -> dict[str, torch.Tensor]:
    """The values the checkpoint must hold, under its names (a collective on sharded tensors)."""
    out = {k: _full(v) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out.update({f"optimizer.state.{name}.{k}": _full(v) for k, v in opt.state[p].items()})
    out["counter.value"] = counter.value.clone()
    return out


def _next_step_right_after_save(rank: int, world_size: int, folder: str) -> None:
    """FSDP over 2 ranks; each save is followed at once by the optimizer's step (the gradients
    are ready before `save()`, so nothing hides the copy) and an in-place change of a user
    state: the checkpoint holds the values at `save()`, in every mode."""
    from torchtitan_ckpt.example.config import load_job_config
    from torchtitan_ckpt.example.train import build_model, shard_model

    torch.manual_seed(1)
    inputs, labels = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    for mode in ("disabled", *MODES):
        model = build_model(load_job_config(None, []))
        shard_model(model, world_size)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
        counter = TensorState(torch.zeros(3))  # the training loop changes it in place
        config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0)
        expected = {}
        with CheckpointManager(config, [model], optimizers=opt, states={"counter": counter},
                               base_folder=os.path.join(folder, mode)) as manager:
            for step in (1, 2, 3):
                F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
                if step > 1:
                    expected[step] = _snapshot(model, opt, counter)
                manager.save(step)
                opt.step()  # changes every parameter and moment in place
                counter.value.add_(1)
                opt.zero_grad()
            after = _snapshot(model, opt, counter)
        assert not step_hooks.waits(opt)  # close() detaches the manager from the optimizer's steps
        for step, values in expected.items():  # read on every rank: dcp.load is a collective
            saved = read_checkpoint(layout.step_dir(os.path.join(folder, mode, "checkpoint"), step))
            assert_same({k: saved[k] for k in values}, values)
        assert not torch.equal(after["output.weight"], expected[3]["output.weight"])


@pytest.mark.multirank
def test_the_next_optimizer_step_never_reaches_the_checkpoint(tmp_path):
    spawn(2, _next_step_right_after_save, str(tmp_path))


def _job(tmp_path, mode: str, **config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ck = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0, **config)
    return model, opt, CheckpointManager(ck, [model], optimizers=opt, base_folder=str(tmp_path))


def _train_step(model, opt) -> None:
    model(torch.randn(16, 8)).square().mean().backward()  # a forward in train mode moves BatchNorm's stats
    opt.step()
    opt.zero_grad()


def _saved(tmp_path, step: int) -> dict[str, torch.Tensor]:
    return read_checkpoint(layout.step_dir(os.path.join(tmp_path, "checkpoint"), step))


@pytest.mark.parametrize("mode", MODES)
def test_buffers_changed_by_the_next_forward_are_saved_as_they_were(tmp_path, mode):
    model, opt, manager = _job(tmp_path, mode)
    _train_step(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(1)
    _train_step(model, opt)
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    manager.close()
    saved = _saved(tmp_path, 1)
    assert_same({k: saved[k] for k in before}, before)


@pytest.mark.parametrize("mode", MODES)
def test_maybe_wait_for_staging_makes_a_change_by_hand_safe(tmp_path, mode):
    model, opt, manager = _job(tmp_path, mode)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(1)
    manager.maybe_wait_for_staging()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)  # e.g. an EMA update outside the optimizer
    manager.close()
    saved = _saved(tmp_path, 1)
    assert_same({k: saved[k] for k in before}, before)


def _staging_held(monkeypatch) -> threading.Event:
    """Staging in the background begins only once the event returned is set: a copy slower than
    the next step's forward and backward, made certain."""
    gate = threading.Event()
    stage = BackgroundSaves._stage  # noqa: SLF001

    def held(self, *args, **kwargs):
        gate.wait(60)
        return stage(self, *args, **kwargs)

    monkeypatch.setattr(BackgroundSaves, "_stage", held)
    return gate


@pytest.mark.parametrize("mode", MODES)
def test_a_close_on_another_thread_still_holds_back_the_next_optimizer_step(tmp_path, monkeypatch, mode):
    """A watchdog's close() right after save(), the copy still to be made: the training thread's
    next optimizer step waits for the copy as it would without the close() (which let it through
    at once: the step saved held the next step's values)."""
    gate = _staging_held(monkeypatch)
    model, opt, manager = _job(tmp_path, mode)
    _train_step(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(1)
    closer = threading.Thread(target=manager.close)
    closer.start()
    while not manager._closed:  # noqa: SLF001
        time.sleep(0.005)
    time.sleep(0.1)  # close() waits for the save in flight
    threading.Timer(0.3, gate.set).start()
    _train_step(model, opt)
    closer.join()
    saved = _saved(tmp_path, 1)
    assert_same({k: saved[k] for k in before}, before)


@pytest.mark.parametrize("mode", MODES)
def test_a_close_while_an_optimizer_step_waits_in_its_hooks_fails_no_step(tmp_path, monkeypatch, mode):
    """close() on another thread while the training thread's optimizer step waits in the
    manager's hook for the copy, a hook of the user's after it: the step goes through (removing
    the manager's hook while torch walked them failed it: "OrderedDict mutated during
    iteration")."""
    gate = _staging_held(monkeypatch)
    model, opt, manager = _job(tmp_path, mode)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    _train_step(model, opt)
    manager.save(1)
    weight = model[0].weight.detach().clone()
    closer = threading.Timer(0.2, manager.close)
    closer.start()
    threading.Timer(1.0, gate.set).start()
    _train_step(model, opt)  # its step waits for the copy until the gate opens; close() comes meanwhile
    closer.join()
    assert len(calls) == 2 and not torch.equal(model[0].weight, weight)
    assert not step_hooks.waits(opt)


@pytest.mark.parametrize("mode", MODES)
def test_verify_staging_names_a_parameter_changed_outside_the_optimizer(tmp_path, mode):
    model, opt, manager = _job(tmp_path, mode, verify_staging=True)
    _train_step(model, opt)
    manager.save(1)
    _train_step(model, opt)  # through the optimizer: nothing to report
    manager.save(2)
    with torch.no_grad():
        model[2].bias.add_(1.0)
    with pytest.raises(StagingMismatchError, match=r"^2\.bias changed between save\(\) and the optimizer's step"):
        _train_step(model, opt)
    _train_step(model, opt)  # reported once
    manager.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("then", ["save", "wait", "load", "close"])
def test_verify_staging_names_a_change_by_hand_before_any_optimizer_step(tmp_path, mode, then):
    """A change by hand followed by the next save(), wait(), load() or close() instead of an
    optimizer step: the save in flight may have copied it too."""
    model, opt, manager = _job(tmp_path, mode, verify_staging=True)
    _train_step(model, opt)
    manager.save(1)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    until = r"the next save\(\), wait\(\), load\(\) or close\(\)"
    with pytest.raises(StagingMismatchError, match=rf"^0\.weight changed between save\(\) and {until}"):
        {"save": lambda: manager.save(2), "wait": manager.wait, "load": manager.load, "close": manager.close}[then]()
    manager.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_saves_staged_copy_is_let_go_by_that_save_not_by_the_next_save_call(mode):
    """Freeing a whole state's copy takes tens of ms: the save's own thread does it once it has
    written the copy, so the next `save()` does not."""
    saves, written = make_strategy(mode), []

    def write(staged, sink):
        staged.done()
        written.append(weakref.ref(staged.state["w"]))

    saves.submit({"w": torch.ones(4)}, SaveJob(1, "", lambda: None, write, lambda _: None))
    while saves.in_flight():
        time.sleep(0.01)
    assert written and written[0]() is None
    saves.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_param_group_added_after_the_manager_is_built_is_saved(tmp_path, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model[0].parameters(), lr=0.1)
    ck = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0)
    with CheckpointManager(ck, [model], optimizers=opt, base_folder=str(tmp_path)) as manager:
        _train_step(model, opt)
        manager.save(1)
        opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.5})
        _train_step(model, opt)
        manager.save(2)
        expected = {f"optimizer.state.1.weight.{k}": v.clone() for k, v in opt.state[model[1].weight].items()}
    saved = _saved(tmp_path, 2)
    assert_same({k: saved[k] for k in expected}, expected)
    assert saved["optimizer.param_groups.1.weight.lr"] == 0.5


def test_verify_staging_needs_an_async_mode():
    with pytest.raises(ConfigError, match="checkpoint.verify_staging = True: checks the async modes"):
        Checkpoint(enable=True, verify_staging=True).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_staging_on_a_side_stream_holds_the_values_at_save_time(tmp_path, mode):
    """GPU state: the side stream's copies (non-blocking into pinned buffers in the pinned mode)
    hold the values at `save()`, and the optimizer's step right after waits for them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0)
    with CheckpointManager(config, [model], optimizers=opt, base_folder=str(tmp_path)) as manager:
        for step in (1, 2, 3):
            model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
            opt.step()
            before = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            before.update({f"optimizer.state.{n}.exp_avg": opt.state[p]["exp_avg"].cpu()
                           for n, p in model.named_parameters()})
            manager.save(step)
            model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
    saved = _saved(tmp_path, 3)
    assert_same({k: saved[k] for k in before}, before)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_staged_tensor_is_ready_to_write_once_its_copy_is_made(reuse):
    """Writing overlaps staging: a writer waits on the copy of the tensor it writes (here a view
    of one), not on the whole state's, and reads the values of `save()` time."""
    stager = (SharedArenas() if reuse else FreshCopies())
    state = {"a": torch.arange(8.0), "c": torch.arange(12.0).reshape(3, 4), "n": 5}
    copies = stager.layout(state)
    read: list[torch.Tensor] = []

    def write_c_rows() -> None:
        rows = copies.staged["c"][1:]
        copies.ready(rows)
        read.append(rows.clone())

    writer = threading.Thread(target=write_c_rows)
    writer.start()
    writer.join(0.2)
    assert writer.is_alive() and not read  # nothing is copied yet
    copies.run()
    writer.join()
    copies.done()
    assert torch.equal(read[0], state["c"][1:])
    assert_same(copies.staged, state)
    stager.release()


@pytest.mark.parametrize("reuse", [False, True])
def test_the_saves_own_clone_in_host_memory_is_staged_as_it_is(reuse):
    """`freeze` clones the tensors no optimizer step guards (buffers; all of them without an
    optimizer), and `async` staged a copy of each clone, three of it held at once. The clone is
    the staged tensor now, written without waiting on any copy; the pinned arenas still take a
    copy (the writer process reads them)."""
    stager = (SharedArenas() if reuse else FreshCopies())
    clone, live = torch.arange(8.0), torch.arange(4.0)
    copies = stager.layout({"buf": clone, "w": live}, owned=lambda path: path == ("buf",))
    if not reuse:
        assert copies.staged["buf"] is clone
        writer = threading.Thread(target=copies.ready, args=(clone[2:],))
        writer.start()
        writer.join(5)
        assert not writer.is_alive()  # before any copy is made
    copies.run()
    copies.done()
    assert copies.staged["w"].data_ptr() != live.data_ptr()
    assert (copies.staged["buf"].data_ptr() == clone.data_ptr()) != reuse
    assert_same(copies.staged, {"buf": torch.arange(8.0), "w": torch.arange(4.0)})
    stager.release()


def test_a_warm_pinned_save_copies_a_tensor_no_step_guards_into_its_place_at_once():
    """`async_with_pinned_mem` cloned such a tensor in `save()`, then copied the clone into its
    place in the background: a warm save of a 1 GiB buffer faulted in 1 GiB. Its place laid out,
    it is copied there in `save()` (a Parameter too, detached), and staging has nothing left to
    copy of it; a small one is cloned still (cheaper than finding its place)."""
    from torchtitan_ckpt.io.stagers import _STAGE_NOW_BYTES

    stager = SharedArenas()
    values = torch.arange(_STAGE_NOW_BYTES // 4, dtype=torch.float32)
    buf, small = values.clone(), torch.arange(8.0)
    copies = stager.layout({"buf": buf, "small": small})
    copies.run()
    copies.done()
    place = copies.staged["buf"].data_ptr()
    buf.add_(1)
    staged = stager.stage_now(("buf",), torch.nn.Parameter(buf))
    assert staged.data_ptr() == place and torch.equal(staged, values + 1) and not staged.requires_grad
    buf.add_(1)  # training goes on: the staged copy keeps the values of the save
    copies = stager.layout({"buf": staged, "small": small.clone()}, owned=lambda path: True)
    assert copies.staged["buf"] is staged
    copies.ready(staged)  # no copy to wait for
    copies.run()
    copies.done()
    assert torch.equal(copies.staged["buf"], values + 1) and torch.equal(copies.staged["small"], small)
    assert stager.stage_now(("small",), small) is None
    assert stager.stage_now(("new",), buf) is None  # no place yet: `freeze` clones it
    assert stager.stage_now(("buf",), torch.cat([buf, buf])) is None  # another shape: so does it
    stager.release()


def test_a_dtensor_on_a_gpu_mesh_is_staged_into_host_memory_and_written_from_there(tmp_path):
    """A staged DTensor keeps its host copy as its local tensor whatever its mesh's device:
    `DTensor.from_local` would move the copy to a CUDA mesh's GPU while nothing was copied in yet,
    and the write would take that stale GPU tensor. Here a real DTensor on a mesh of device type
    "cuda" (built without a GPU: no collective runs), its shard kept on the CPU so it can be
    copied on this machine; before, laying it out failed on the move ("not compiled with CUDA")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
        shard = torch.arange(12.0).reshape(3, 4)
        live = DTensor(shard, DTensorSpec(mesh, (Shard(0),), TensorMeta(shard.shape, shard.stride(), shard.dtype)),
                       requires_grad=False)
        for reuse in (False, True):
            stager = (SharedArenas() if reuse else FreshCopies())
            copies = stager.layout({"w": live})
            copies.run()
            copies.done()
            staged = copies.staged["w"]
            assert isinstance(staged, DTensor) and staged.device_mesh is mesh and staged.placements == (Shard(0),)
            assert staged.to_local().device.type == "cpu" and staged.to_local().data_ptr() != shard.data_ptr()
            assert torch.equal(staged.to_local(), shard) and staged.shape == live.shape
            stager.release()
    finally:
        dist.destroy_process_group()


def test_a_staging_failure_reaches_a_writer_waiting_on_it():
    copies = FreshCopies().layout({"a": torch.ones(4)})
    copies.fail(MemoryError("staging the step-4 state: out of memory"))
    with pytest.raises(MemoryError, match="out of memory"):
        copies.ready(copies.staged["a"])
    with pytest.raises(MemoryError, match="out of memory"):
        copies.done()


@pytest.mark.parametrize("mode", MODES)
def test_the_first_tensors_copied_are_written_while_the_rest_is_still_being_staged(tmp_path, monkeypatch, mode):
    """Writing overlaps staging in both modes (in `async_with_pinned_mem`, in the writer
    process): staging is held after its first copy, the largest tensor (past the writer's
    64 MiB batch, so its bytes go to the kernel at once), until that tensor's bytes are in the
    step folder (all but the direct write's block still filling, which waits for the next
    tensor), which they reach only if the write did not wait for the rest."""
    from torchtitan_ckpt import staging
    from torchtitan_ckpt.io import direct

    model = torch.nn.Sequential(torch.nn.Linear(4097, 4096, bias=False), torch.nn.Linear(16, 4))
    folder = str(tmp_path / "ck")
    armed, seen = [], []
    real_mark = staging.Copies._mark

    def held_mark(self, made: int) -> None:
        real_mark(self, made)
        if made == 1 and armed and not seen:
            first = self._pairs[0][1].nbytes - direct.BLOCK_BYTES
            step = os.path.join(folder, "step-2")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                names = [n for n in os.listdir(step) if n.endswith(".distcp")] if os.path.isdir(step) else []
                if sum(os.path.getsize(os.path.join(step, n)) for n in names) >= first:
                    seen.append(True)
                    return
                time.sleep(0.01)
            seen.append(False)

    monkeypatch.setattr(staging.Copies, "_mark", held_mark)
    config = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0, folder=folder)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # the parameters are staged in the background, not cloned
    with CheckpointManager(config, [model], optimizers=sgd) as manager:
        manager.save(1)  # the writer process is up once this save is done
        manager.wait()
        armed.append(True)
        manager.save(2)
        manager.wait()
    assert seen == [True]
    saved = read_checkpoint(os.path.join(folder, "step-2"))
    assert_same({k: saved[k] for k in model.state_dict()}, model.state_dict())


@pytest.mark.parametrize("mode", MODES)
def test_a_save_that_fails_before_its_staging_ends_is_waited_for_until_staging_stops(mode, monkeypatch):
    """The next save reuses the arenas (pinned) and the shared count of copies: a failed save's
    staging still copying beside the next one's would mix old bytes into the new checkpoint."""
    from torchtitan_ckpt import staging

    release, copied = threading.Event(), threading.Event()
    real_run = staging.Copies.run

    def held_run(self) -> None:
        release.wait(10)
        real_run(self)
        copied.set()

    monkeypatch.setattr(staging.Copies, "run", held_run)

    def refuse() -> None:
        raise OSError("no space left while preparing the step folder")

    strategy = make_strategy(mode)
    try:
        job = SaveJob(step=1, path="unused", prepare=refuse, write=lambda staged, sink: None, commit=lambda w: None)
        strategy.submit({"w": torch.ones(1 << 16)}, job)
        threading.Timer(0.5, release.set).start()
        with pytest.raises(OSError, match="no space left"):
            strategy.wait()
        assert copied.is_set()  # wait() returned only once the staging had stopped
    finally:
        release.set()
        strategy.close()
