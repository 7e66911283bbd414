"""The manager called again while a call of its is in progress: from a signal handler (which
Python runs on the main thread, between two bytecodes of whatever it interrupted) or from
another thread. Real signals, sent by the process to itself from inside the call."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from torch import nn

from torchtitan_ckpt import CheckpointManager, layout
from torchtitan_ckpt.config import Checkpoint
from torchtitan_ckpt.errors import CheckpointError, PartialLoadError


class _Signalling:
    """A job's own state whose `state_dict()` (inside `save()`) or `load_state_dict()` (inside
    `load()`, once the model's tensors are filled) sends `signum` to this process."""

    def __init__(self, signum: int | None = None, on_load: bool = False):
        self.signum, self.on_load, self.value = signum, on_load, 0

    def state_dict(self):
        if self.signum is not None and not self.on_load:
            os.kill(os.getpid(), self.signum)
        return {"value": self.value}

    def load_state_dict(self, state):
        if self.signum is not None and self.on_load:
            os.kill(os.getpid(), self.signum)
        self.value = state["value"]


def _manager(folder, state, mode="disabled"):
    model = nn.Linear(4, 4)
    config = Checkpoint(enable=True, interval=1, async_mode=mode, folder="ckpt", last_save_model_only=False)
    return model, CheckpointManager(config, [model], states={"job": state}, base_folder=str(folder))


@pytest.fixture
def handler():
    """Installs a SIGUSR1 handler for the test; puts the previous one back."""
    previous = signal.getsignal(signal.SIGUSR1)
    yield lambda f: signal.signal(signal.SIGUSR1, f)
    signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_handler_saving_during_a_save_is_refused_and_nothing_is_rewritten(tmp_path, handler, mode):
    """A SIGTERM handler saving the step being saved committed that step, which the interrupted
    save then rewrote in place: a committed step without `.metadata`, or with files of 0 bytes.
    In the async modes the handler's save deadlocked on the background executor's lock."""
    state = _Signalling()
    model, manager = _manager(tmp_path, state, mode)
    manager.save(1, last_step=True)
    refused = []

    def save_now(*_):
        try:
            manager.save(2, last_step=True)
        except CheckpointError as e:
            refused.append(str(e))
            raise
    handler(save_now)
    state.signum = signal.SIGUSR1
    with pytest.raises(CheckpointError, match=r"save\(\) called while save\(\) is in progress on the same thread"):
        manager.save(2, last_step=True)
    assert refused
    state.signum = None
    manager.close()
    folder = os.path.join(tmp_path, "ckpt")
    assert layout.committed_steps(folder) == [1]
    _, manager = _manager(tmp_path, _Signalling())
    assert manager.load()
    manager.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_handler_closing_during_a_save_closes_once_the_save_is_done(tmp_path, handler, mode):
    state = _Signalling()
    _, manager = _manager(tmp_path, state, mode)
    handler(lambda *_: manager.close())
    state.signum = signal.SIGUSR1
    assert manager.save(1, last_step=True)
    with pytest.raises(CheckpointError, match=r"save\(\) called after close\(\)"):
        manager.save(2)
    assert layout.committed_steps(os.path.join(tmp_path, "ckpt")) == [1]


def test_close_from_another_thread_waits_for_the_save_in_progress(tmp_path):
    """A watchdog's close() returned while the main thread's save was still writing, and let go
    of the folder's lock, which another job could then take."""
    order = []
    closed = threading.Event()

    class Watched(_Signalling):
        def state_dict(self):
            def watchdog():
                manager.close()
                order.append("closed")
                closed.set()
            threading.Thread(target=watchdog).start()
            assert not closed.wait(0.3)  # close() waits for this save
            return super().state_dict()

    _, manager = _manager(tmp_path, Watched())
    assert manager.save(1)
    order.append("saved")
    assert closed.wait(30)
    assert order == ["saved", "closed"]
    assert layout.committed_steps(os.path.join(tmp_path, "ckpt")) == [1]


def test_ctrl_c_once_tensors_are_loaded_leaves_saves_refused(tmp_path):
    """A KeyboardInterrupt after the load had begun filling the model left it part loaded, and
    the `finally: save()` of the job committed that mix."""
    # Python's own SIGINT handler, which a process started in a shell's background lacks (ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_load(tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_load(tmp_path):
    model, manager = _manager(tmp_path, _Signalling())
    with torch.no_grad():
        model.weight.fill_(2.0)
    manager.save(1, last_step=True)
    manager.close()
    model, manager = _manager(tmp_path, _Signalling(signal.SIGINT, on_load=True))
    with pytest.raises(KeyboardInterrupt):
        manager.load()
    assert bool((model.weight == 2).all())
    with pytest.raises(CheckpointError, match=r"save\(2\) refused: .*\(KeyboardInterrupt: \)"):
        manager.save(2)
    manager.close()
    assert isinstance(manager._half_loaded, PartialLoadError)
