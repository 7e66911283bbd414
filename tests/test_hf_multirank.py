"""Hugging Face import and export on 2 real gloo ranks with the FSDP-sharded example model."""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import shutil
import struct
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.helpers import DEBUG_CONFIG, assert_same, fail_reads_after_fill, perturbed, spawn
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.errors import CheckpointError, ConsolidationError, CorruptCheckpointError
from torchtitan_ckpt.example.model import FLAVORS, ModelArgs, Transformer, hf_adapter, hf_config
from torchtitan_ckpt.hf import load_hf, save_hf, shards
from torchtitan_ckpt.hf.adapter import reorder_rows, rope_row_order
from torchtitan_ckpt.hf.consolidate import write_safetensors_one_pass
from torchtitan_ckpt.hf.convert import convert
from torchtitan_ckpt.hf.files import model_file_name
from torchtitan_ckpt.states import ModelState
from torchtitan_ckpt.example.train import build_model, shard_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _assert_same_files(a: str, b: str) -> None:
    """Same safetensors file names, and in each the same tensors bit for bit."""
    before, after = ({os.path.basename(f): load_file(f) for f in glob.glob(os.path.join(d, "*.safetensors"))}
                     for d in (a, b))
    assert sorted(before) == sorted(after)
    for file in before:
        assert_same(before[file], after[file])


def _check_permutation_across_a_split_head(world_size: int, out: str) -> None:
    """3 heads of 8 rows on 2 ranks: rank 0 holds rows 0-11, so head 1 is split between them;
    each rank writes its own rows at their HF places, and the file is one process's. With 4
    heads, each rank holds 2 whole ones: its rows are permuted where they lie, with no gather,
    and it keeps exactly its shard."""
    mesh = init_device_mesh("cpu", (world_size,))
    w = torch.arange(24.0 * 2).reshape(24, 2)
    hf = reorder_rows(distribute_tensor(w, mesh, [Shard(0)]), rope_row_order(8))
    assert torch.equal(hf.full(), reorder_rows(w, rope_row_order(8)))
    write_safetensors_one_pass({"w": hf}, out)
    assert torch.equal(load_file(os.path.join(out, model_file_name(1, 1)))["w"], reorder_rows(w, rope_row_order(8)))
    w = torch.arange(32.0 * 2).reshape(32, 2)
    hf = reorder_rows(distribute_tensor(w, mesh, [Shard(0)]), rope_row_order(8))
    assert isinstance(hf, DTensor) and hf.placements == (Shard(0),)
    assert torch.equal(hf.to_local(), reorder_rows(w, rope_row_order(8)).chunk(world_size)[dist.get_rank()])


def _import_and_export(rank: int, world_size: int, src: str, out: str, expected: torch.Tensor) -> None:
    _check_permutation_across_a_split_head(world_size, os.path.join(out, "split_head"))
    config = load_job_config(DEBUG_CONFIG, [])
    model = build_model(config)  # other weights than the checkpoint's
    shard_model(model, world_size)
    args = model.args
    state = ModelState([model])
    sd = state.state_dict()
    load_hf(sd, src, hf_adapter(args))
    state.load_state_dict(sd)
    with torch.no_grad():
        assert (model(TOKENS) - expected).abs().max() < 1e-5

    # the assets' split: the same files, bit for bit
    save_hf(state.state_dict(), os.path.join(out, "same"), hf_adapter(args, hf_assets_path=src))
    # the planner's split, files written by both ranks (loaded by transformers below)
    save_hf(state.state_dict(), os.path.join(out, "planned"), hf_adapter(args), max_shard_size="100KB")
    if rank == 0:
        _assert_same_files(src, os.path.join(out, "same"))

    # the CLI's path under torchrun: HF -> DCP -> HF, each rank holding half of every tensor
    convert("dcp", src, os.path.join(out, "dcp"))
    convert("hf", os.path.join(out, "dcp"), os.path.join(out, "hf"), hf_assets_path=src)
    if rank == 0:
        _assert_same_files(src, os.path.join(out, "hf"))


def test_sharded_import_and_export_on_two_ranks(tmp_path):
    args = FLAVORS[load_job_config(DEBUG_CONFIG, []).model.flavor]
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(args))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        expected = hf(TOKENS).logits
    src = str(tmp_path / "src")
    hf.save_pretrained(src, max_shard_size="150KB")
    assert len(glob.glob(os.path.join(src, "*.safetensors"))) >= 3
    spawn(2, _import_and_export, src, str(tmp_path / "out"), expected)
    planned = str(tmp_path / "out" / "planned")
    assert len(glob.glob(os.path.join(planned, "*.safetensors"))) == 4
    exported = transformers.LlamaForCausalLM.from_pretrained(planned).eval()
    with torch.no_grad():
        assert (exported(TOKENS).logits - expected).abs().max() < 1e-5


# ---------------------------------------------------------------------------- shards read in place

# head_dim 16: on 2 ranks wq's 48 rows split inside head 1, wk's 16 rows inside its only head,
# and the 255 rows of the embedding and the head split unevenly (128 / 127)
MID_HEAD = ModelArgs(dim=48, n_layers=2, n_heads=3, n_kv_heads=1, vocab_size=255, multiple_of=32)
MID_HEAD_TOKENS = torch.randint(0, 255, (2, 24), generator=torch.Generator().manual_seed(1))


def _tensor_bytes(path: str) -> dict[str, tuple[int, int, list[int]]]:
    """HF name -> [start, end) of its bytes in the safetensors file `path`, and its shape, from
    the header as the format defines it."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: (8 + length + e["data_offsets"][0], 8 + length + e["data_offsets"][1], e["shape"])
            for name, e in header.items()}


def _merged(ranges) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for file, start, end in sorted(ranges):
        if out and out[-1][0] == file and out[-1][2] >= start:
            out[-1] = (file, out[-1][1], max(end, out[-1][2]))
        else:
            out.append((file, start, end))
    return out


def _needed_ranges(src: str, rank: int, world_size: int) -> dict[str, tuple[str, int, int, int]]:
    """HF name -> the bytes this rank must read: its rows (FSDP splits rows as torch.chunk does),
    for wq/wk widened to whole heads; and how many of those bytes are its own rows."""
    adapter = hf_adapter(MID_HEAD)
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for source in adapter.sources.values():
        name = source.name
        start, end, shape = _tensor_bytes(os.path.join(src, weight_map[name]))[name]
        rows = torch.arange(shape[0]).chunk(world_size)[rank]
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        row_bytes = (end - start) // shape[0]
        own = (hi - lo) * row_bytes
        if source.row_order:
            head = MID_HEAD.head_dim
            lo, hi = lo // head * head, -(-hi // head) * head
        out[name] = (weight_map[name], start + lo * row_bytes, start + hi * row_bytes, own)
    return out


def _load_mid_head(rank: int, world_size: int, folders: list[tuple[str, dict, torch.Tensor]]) -> None:
    torch.manual_seed(5)
    model = Transformer(MID_HEAD)  # other weights than the checkpoints'
    shard_model(model, world_size)
    state = ModelState([model])
    for src, expected, logits in folders:
        sd = state.state_dict()
        reads = []
        real = shards.read_exact

        def recording(fd, bufs, offset, path):
            places = [(np.frombuffer(b, np.uint8).ctypes.data, len(b)) for b in bufs]
            reads.append((os.path.basename(path), offset, sum(n for _, n in places), places))
            real(fd, bufs, offset, path)

        shards.read_exact = recording
        try:
            load_hf(sd, src, hf_adapter(MID_HEAD))
        finally:
            shards.read_exact = real
        for name, value in sd.items():
            assert torch.equal(value.full_tensor(), expected[name]), f"{src}: {name} differs"
        state.load_state_dict(sd)
        with torch.no_grad():
            assert (model(MID_HEAD_TOKENS) - logits).abs().max() < 1e-5

        # exactly the bytes of this rank's rows (whole heads for wq/wk), each read once
        needed = _needed_ranges(src, rank, world_size)
        assert sum(n for _, _, n, _ in reads) == sum(end - start for _, start, end, _ in needed.values())
        assert _merged((f, o, o + n) for f, o, n, _ in reads) == _merged(n[:3] for n in needed.values())
        if all(t.dtype == torch.float32 for t in load_file(glob.glob(os.path.join(src, "*.safetensors"))[0]).values()):
            # same dtype: every row read lands in its place in the shard's own memory, in our
            # order, with no buffer; only wq/wk's rows of a head outside the shard go elsewhere
            shard_memory = [(v.to_local().data_ptr(), v.to_local().data_ptr() + v.to_local().nbytes)
                            for v in sd.values()]
            outside = [(f, o, size) for f, o, _, places in reads for address, size in places
                       if not any(lo <= address and address + size <= hi for lo, hi in shard_memory)]
            qk = {name: n for name, n in needed.items() if re.search(r"\.[qk]_proj\.", name)}
            assert {(f, o) for f, o, _ in outside} <= {(f, start) for f, start, _, _ in qk.values()}
            assert sum(size for _, _, size in outside) == sum(end - start - own for _, start, end, own in qk.values())
            assert outside  # the shards do cut heads here


def _reference(folder: str) -> dict[str, torch.Tensor]:
    """Our full state dict from an HF folder, built without load_hf: safetensors' own reader,
    then the inverse permutation of whole wq/wk tensors, in fp32."""
    hf = {}
    for file in glob.glob(os.path.join(folder, "*.safetensors")):
        hf.update(load_file(file))
    adapter = hf_adapter(MID_HEAD)
    return {ours: _from_hf_rows(hf[s.name].float(), s.row_order) if s.row_order else hf[s.name].float()
            for ours, s in adapter.sources.items()}


def _from_hf_rows(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Our row k of each block is the HF row order[k] of that block."""
    return t.reshape(-1, len(order), *t.shape[1:])[:, list(order)].reshape(t.shape)


def test_shards_split_inside_heads_load_bit_identically_on_two_ranks(tmp_path):
    torch.manual_seed(4)
    config = transformers.LlamaConfig(**hf_config(MID_HEAD))
    hf = perturbed(transformers.LlamaForCausalLM(config).eval())
    folders = []
    for dtype in (torch.float32, torch.bfloat16):  # bf16: read, cast to fp32, reordered
        src = str(tmp_path / str(dtype))
        copy.deepcopy(hf).to(dtype).save_pretrained(src, max_shard_size="40KB")
        assert len(glob.glob(os.path.join(src, "*.safetensors"))) >= 3
        with torch.no_grad():  # transformers' fp32 logits of what the folder holds
            logits = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)(MID_HEAD_TOKENS).logits
        folders.append((src, _reference(src), logits))
    spawn(2, _load_mid_head, folders)


# ---------------------------------------------------------------------------- peak memory

# wq and wk of 4 MiB each (2 heads of 512 rows), 50 MB of weights per rank in all
BIG_HEADS = ModelArgs(dim=1024, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, multiple_of=256)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024


def _sharded_big_heads(world_size: int, seed: int) -> Transformer:
    """A sharded model, each rank filling only its own shards (quicker than a full init)."""
    with torch.device("meta"):
        model = Transformer(BIG_HEADS)
    shard_model(model, world_size)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.02, 0.02, generator=generator)
    return model


def _peak_of_a_load(rank: int, world_size: int, folder: str) -> None:
    adapter = hf_adapter(BIG_HEADS)
    model = _sharded_big_heads(world_size, seed=rank)
    save_hf(ModelState([model]).state_dict(), folder, adapter)
    fresh = _sharded_big_heads(world_size, seed=rank + 10)
    sd = ModelState([fresh]).state_dict()
    load_hf(sd, folder, adapter)  # first-call costs (lazy imports, thread arenas) are not the load's
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    load_hf(sd, folder, adapter)
    peak = _status_bytes("VmHWM") - before
    for ours, loaded in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(ours.to_local(), loaded.to_local())
    one_wq = BIG_HEADS.dim * BIG_HEADS.dim * 4
    assert peak < one_wq, f"rank {rank}: {peak / 2**20:.1f} MiB more memory during the load"


def test_a_load_never_holds_a_whole_q_projection(tmp_path):
    """The old way (every rank reading wq and wk whole) held at least both layers' full wq and wk
    at once (16 MiB; 60-64 MiB measured); reading each rank's heads into one reused piece buffer
    (its 2 MiB of a wq) stays under one full wq (4 MiB)."""
    spawn(2, _peak_of_a_load, str(tmp_path / "hf"))


# ---------------------------------------------------------------------------- errors


def _one_rank_fails_to_read(rank: int, world_size: int, src: str, damaged: str) -> None:
    model = build_model(load_job_config(DEBUG_CONFIG, []))
    shard_model(model, world_size)
    if rank == 1:  # rank 1 sees a damaged copy (as a node with a bad disk or cache would)
        with pytest.raises(CorruptCheckpointError, match=r"model-00001-of-0000\d\.safetensors"):
            load_hf(ModelState([model]).state_dict(), damaged, hf_adapter(model.args))
    else:
        with pytest.raises(CheckpointError, match=rf"reading {src} failed on rank 1: CorruptCheckpointError"):
            load_hf(ModelState([model]).state_dict(), src, hf_adapter(model.args))


def test_a_read_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    """Otherwise the other rank would return and wait forever in its next collective."""
    args = FLAVORS[load_job_config(DEBUG_CONFIG, []).model.flavor]
    src = str(tmp_path / "hf")
    save_hf(Transformer(args).state_dict(), src, hf_adapter(args), max_shard_size="100KB")
    damaged = str(tmp_path / "damaged")
    shutil.copytree(src, damaged)
    first = sorted(f for f in os.listdir(damaged) if f.startswith("model-00001"))[0]
    with open(os.path.join(damaged, first), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 8)  # the header promises bytes the file lacks
    spawn(2, _one_rank_fails_to_read, src, damaged)


def _one_rank_fails_to_read_a_step(rank: int, world_size: int, step: str, out: str) -> None:
    if rank == 1:
        fail_reads_after_fill()
    with pytest.raises(CheckpointError) as failed:
        convert("hf", step, out)
    assert str(failed.value).startswith(f"reading {step} failed: PartialLoadError: loading {step} failed after it "
                                        "had begun writing the job's tensors in place (OSError: [Errno 5] "
                                        "Input/output error)"), str(failed.value)


def test_a_read_error_of_convert_on_one_rank_is_its_own_on_every_rank(tmp_path):
    """DCP hands a rank's failure to every rank pickled: ours, whose constructors take other
    parameters than their message, failed to unpickle, and every rank raised a TypeError
    ("__init__() missing 1 required positional argument")."""
    args = FLAVORS[load_job_config(DEBUG_CONFIG, []).model.flavor]
    src, step = str(tmp_path / "hf"), str(tmp_path / "step")
    save_hf(Transformer(args).state_dict(), src, hf_adapter(args))
    convert("dcp", src, step)
    spawn(2, _one_rank_fails_to_read_a_step, step, str(tmp_path / "out"))


class _CopyFails(torch.Tensor):
    """A tensor whose copy by the method `failing` runs out of memory, as a cast or a copy to
    host memory of a large tensor can on one rank."""

    failing: Any = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is cls.failing:
            raise MemoryError(f"injected: Tensor.{func.__name__} found no memory")
        return super().__torch_function__(func, types, args, kwargs or {})


class _CastFails(_CopyFails):
    failing = torch.Tensor.to


class _HostCopyFails(_CopyFails):
    failing = torch.Tensor.cpu


def _one_rank_fails_to_copy(rank: int, world_size: int, out: str) -> None:
    """Pipeline stages: rank 1 holds layer 1, the norm and the head, and its norm's copy fails
    when cast (before planning) or when copied to host memory (before writing)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # not 30 min if a rank hangs
    torch.manual_seed(0)
    sd = Transformer(MID_HEAD).state_dict()
    last = {k for k in sd if k.startswith("layers.1.") or k in ("norm.weight", "output.weight")}
    stage = {k: v for k, v in sd.items() if (k in last) == (rank == 1)}
    for failing, dtype, step in [(_CastFails, torch.bfloat16, "planning the export"),
                                 (_HostCopyFails, None, "writing tensor data")]:
        if rank == 1:
            stage["norm.weight"] = sd["norm.weight"].as_subclass(failing)
        message = f"injected: Tensor.{failing.failing.__name__} found no memory"
        start = time.perf_counter()
        with pytest.raises(MemoryError if rank == 1 else ConsolidationError,
                           match=re.escape(message if rank == 1 else f"{step} failed on rank 1: MemoryError: {message}")):
            save_hf(stage, out, hf_adapter(MID_HEAD), dtype=dtype, process_group=group)
        assert time.perf_counter() - start < 30  # not the group's timeout
        assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
        dist.barrier(group)


def test_a_copy_failing_on_one_rank_fails_the_export_on_every_rank_at_once(tmp_path):
    """A rank whose cast or host copy fails raises in the step every rank shares, so the others
    raise too instead of waiting in the next collective until the group's timeout."""
    spawn(2, _one_rank_fails_to_copy, str(tmp_path / "hf"))


def _tied_stages(rank: int, world_size: int, tmp: str, pipelined: bool) -> None:
    """The embedding and the head tied on one rank's two stages (a V-shaped schedule), or held by
    different ranks (a pipeline), under a config that ties them."""
    from torch import nn

    from torchtitan_ckpt import Checkpoint, CheckpointManager
    from torchtitan_ckpt.errors import ConfigError

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, tie_embeddings=True)
    first, last = nn.Module(), nn.Module()
    first.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
    last.output = nn.Linear(args.dim, args.vocab_size, bias=False)
    last.output.weight = first.tok_embeddings.weight
    parts = ([first] if rank == 0 else [last]) if pipelined else [first, last]
    config = Checkpoint(enable=True, last_save_in_hf=True)
    make = lambda: CheckpointManager(config, parts, base_folder=tmp, state_dict_adapter=hf_adapter(args))  # noqa: E731
    if not pipelined:
        make().close()
        return
    with pytest.raises(ConfigError, match=r"the model's output.weight is a parameter of its own \(on rank 1\)"):
        make()  # on every rank: the other one waited in the next collective until its timeout


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_tie_across_stages_is_judged_on_every_rank_alike(tmp_path, pipelined):
    spawn(2, _tied_stages, str(tmp_path), pipelined)


class _SameNames:
    """TorchTitan's adapter surface, changing no name (its assets: a bare config.json)."""

    def __init__(self, hf_assets_path: str):
        self.hf_assets_path = hf_assets_path
        self.fqn_to_index_mapping = None

    def to_hf(self, state_dict):
        return dict(state_dict)

    def from_hf(self, hf_state_dict):
        return dict(hf_state_dict)


def _export_tensors_of_no_elements(rank: int, world_size: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from torchtitan_ckpt.hf.save import MODES

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.arange(16.0).reshape(8, 2))
    model.empty = torch.nn.Parameter(torch.empty(8, 0))
    model.deep = torch.nn.Parameter(torch.empty(2, 0, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    assert model.empty.to_local().shape == (0, 0)  # FSDP2's local shard of no elements, not (4, 0)
    full = torch.arange(24.0).reshape(4, 6)  # and a Shard(1) DTensor whose local shard is a transposed view
    transposed = distribute_tensor(full.t().contiguous(), init_device_mesh("cpu", (world_size,)), [Shard(0)]).t()
    assert not transposed.to_local().is_contiguous()
    for mode in MODES:
        out = os.path.join(tmp, mode)
        save_hf({**model.state_dict(), "t": transposed}, out, _SameNames(os.path.join(tmp, "assets")), mode=mode)
        dist.barrier()
        got = load_file(os.path.join(out, "model-00001-of-00001.safetensors"))
        assert {k: tuple(v.shape) for k, v in got.items()} == {"w": (8, 2), "empty": (8, 0), "deep": (2, 0, 3),
                                                               "t": (4, 6)}
        assert torch.equal(got["w"], torch.arange(16.0).reshape(8, 2)) and torch.equal(got["t"], full)
        back = torch.nn.Module()
        back.w, back.empty, back.deep = (torch.nn.Parameter(torch.zeros(s)) for s in ((8, 2), (8, 0), (2, 0, 3)))
        fully_shard(back, mesh=init_device_mesh("cpu", (world_size,)))
        load_hf(back.state_dict(), out, _SameNames(out))
        assert torch.equal(back.w.full_tensor(), torch.arange(16.0).reshape(8, 2))


def test_tensors_of_no_elements_and_transposed_shards_export_from_every_rank(tmp_path):
    """A parameter of no elements (8 x 0), which FSDP2 shards as (0, 0) on every rank, failed the
    export ("local tensor of shape [0, 0], expected [4, 0]": a run's last save lost), or was
    exported as (4, 0) by the two-phase modes; the export's import failed on it too. A DTensor
    whose local shard is not contiguous (the transpose of a `Shard(0)` one) failed the two-phase
    modes in PyTorch's safetensors writer ("non contiguous tensor")."""
    os.makedirs(tmp_path / "assets")
    (tmp_path / "assets" / "config.json").write_text('{"model_type": "llama", "torch_dtype": "float32"}')
    spawn(2, _export_tensors_of_no_elements, str(tmp_path))


def _a_shard_file_rank_0_does_not_see(rank: int, world_size: int, root: str) -> None:
    from torchtitan_ckpt.hf import save as hf_save  # noqa: PLC0415

    model = build_model(load_job_config(DEBUG_CONFIG, []))
    shard_model(model, world_size)
    consolidate = hf_save.consolidate_safetensors
    if rank == 1:  # its shard files are written, then gone from where rank 0 looks (a disk of its own)
        def after_losing_mine(shards_dir, *args, **kwargs):
            mine = glob.glob(os.path.join(shards_dir, "shard-00002-*.safetensors"))  # numbered from 1
            assert mine
            for path in mine:
                os.unlink(path)
            dist.barrier()
            return consolidate(shards_dir, *args, **kwargs)
        hf_save.consolidate_safetensors = after_losing_mine
    else:
        hf_save.consolidate_safetensors = lambda *args, **kwargs: (dist.barrier(), consolidate(*args, **kwargs))
    for mode in ("rank0", "all_ranks"):
        out = os.path.join(root, mode)
        with pytest.raises(CheckpointError, match=r"of shape \[\d+, \d+\]: the shards in .* cover \d+ of \d+ "
                                                  r"elements; a rank's shard file is missing"):
            save_hf(ModelState([model]).state_dict(), out, hf_adapter(model.args), mode=mode)
        assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))


def test_a_two_phase_export_missing_the_last_rank_shard_file_fails(tmp_path):
    """Consolidation took each tensor's shape from the blocks it found: without the last rank's
    file (a rank writing to a disk of its own) `rank0` exported every sharded tensor cut short
    (its first half), with an index, and said nothing."""
    spawn(2, _a_shard_file_rank_0_does_not_see, str(tmp_path))
