"""Consolidation of DCP HF shards and the one-pass export, in one process: the pure planners, real
DCP shard input, hand-made shards sharded on inner dims, and corrupted input."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from torchtitan_ckpt import cli
from torchtitan_ckpt.hf import consolidate as C
from torchtitan_ckpt.hf.files import model_file_name
from torchtitan_ckpt.policy.split import byte_ranges
from torchtitan_ckpt.errors import CorruptCheckpointError


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 5, generator=g),
        "emb": torch.randn(7, 3, generator=g).bfloat16(),
        "ids": torch.arange(-5, 6, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(2.5),
        "h": torch.randn(3, generator=g).half(),
    }


MAPPING = {"w": 1, "emb": 1, "ids": 2, "mask": 2, "scale": 3, "h": 3}


def read_output(folder: str) -> dict[str, torch.Tensor]:
    index = json.load(open(os.path.join(folder, C.INDEX_FILE)))
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(folder, name)))
    assert sorted(out) == sorted(index["weight_map"])
    return out


def assert_identical(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def assert_aligned(path: str) -> None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert (8 + n) % 8 == 0
    for k, v in header.items():
        if k != "__metadata__":
            assert v["data_offsets"][0] % C.DTYPE_SIZES[v["dtype"]] == 0, k


def write_shards(folder: str, tensors: dict[str, torch.Tensor], dims: dict[str, int], cuts: list[float]) -> None:
    """Hand-made DCP HF shard files: tensor k split along dims[k] at fractions `cuts`, one file per piece."""
    os.makedirs(folder, exist_ok=True)
    for r in range(len(cuts) + 1):
        part, info = {}, {}
        for k, t in tensors.items():
            d = dims.get(k)
            if d is None:
                if r == 0:
                    part[k], info[k] = t, {"saved_offsets": [0] * t.dim()}
                continue
            bounds = [0, *[round(c * t.shape[d]) for c in cuts], t.shape[d]]
            part[k] = t.narrow(d, bounds[r], bounds[r + 1] - bounds[r]).contiguous()
            info[k] = {"saved_offsets": [bounds[r] if i == d else 0 for i in range(t.dim())]}
        save_file(part, os.path.join(folder, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})


# --- pure planners -----------------------------------------------------------------------------


def test_assign_bytes_cuts_items_into_equal_shares():
    assert byte_ranges([10, 2, 4], 2) == [[(0, 0, 8)], [(0, 8, 10), (1, 0, 2), (2, 0, 4)]]
    assert byte_ranges([100], 3) == [[(0, 0, 33)], [(0, 33, 66)], [(0, 66, 100)]]
    assert byte_ranges([1], 3) == [[], [], [(0, 0, 1)]]
    assert byte_ranges([], 2) == [[], []]


def test_block_runs_of_a_dim1_block_are_rows():
    block = C.Block("x", "F32", (0, 2), (3, 2))  # columns 2..3 of a 3x5 tensor
    runs = C.block_runs(block, (3, 5), data_start=16)
    assert (runs.run_bytes, [runs.dst(r) for r in range(3)]) == (8, [24, 44, 64])
    dim0 = C.block_runs(C.Block("x", "F32", (1, 0), (2, 5)), (3, 5), 16)
    assert (dim0.run_bytes, dim0.dst(0), dim0.outer_shape) == (40, 36, ())
    scalar = C.block_runs(C.Block("s", "I64", (), ()), (), 8)
    assert (scalar.run_bytes, scalar.dst(0)) == (8, 8)


def test_output_layout_is_aligned_and_sorted_by_element_size():
    specs = {"b": C.TensorSpec("b", "BOOL", (3,)), "a": C.TensorSpec("a", "F32", (2,)),
             "c": C.TensorSpec("c", "BF16", (1,))}
    (f,) = C.plan_output_files(specs)
    assert f.name == "model-00001-of-00001.safetensors"
    start = len(f.header)
    assert start % 8 == 0 and f.starts == {"a": start, "c": start + 8, "b": start + 10}
    assert f.size == start + 13
    # a number no tensor uses makes no file: the index would not list it, and an import refuses it
    files = C.plan_output_files(specs, {"a": 1, "b": 3, "c": 3})
    assert [(x.name, sorted(x.starts)) for x in files] == [(model_file_name(1, 2), ["a"]),
                                                          (model_file_name(2, 2), ["b", "c"])]


def test_full_tensors_rejects_gaps_and_overlaps():
    a = C.Block("t", "F32", (0, 0), (2, 4), "s1")
    assert C.full_tensors([a, C.Block("t", "F32", (2, 0), (1, 4), "s2")])["t"].shape == (3, 4)
    with pytest.raises(C.InvalidShardsError, match="cover 12 of 16 elements"):
        C.full_tensors([a, C.Block("t", "F32", (3, 0), (1, 4), "s2")])
    with pytest.raises(C.InvalidShardsError, match="overlap"):
        C.full_tensors([a, C.Block("t", "F32", (1, 0), (2, 4), "s2")])
    with pytest.raises(C.InvalidShardsError, match="disagree on dtype"):
        C.full_tensors([a, C.Block("t", "BF16", (2, 0), (1, 4), "s2")])


def test_full_tensors_checks_the_blocks_against_shapes_the_caller_knows():
    """The files record no whole shape: without `shapes` the lost last block of a tensor (a rank's
    file) leaves a smaller tensor that its blocks cover."""
    a = C.Block("t", "F32", (0, 0), (2, 4), "s1")
    assert C.full_tensors([a])["t"].shape == (2, 4)
    assert C.full_tensors([a], {"t": (2, 4)})["t"].shape == (2, 4)
    with pytest.raises(C.InvalidShardsError, match=r"tensor 't' of shape \[3, 4\]: .* cover 8 of 12 elements"):
        C.full_tensors([a], {"t": (3, 4)})
    with pytest.raises(C.InvalidShardsError, match=r"tensor 't': its blocks in \['s1'\] reach \[2, 4\], outside "
                                                   r"its shape \[1, 4\]"):
        C.full_tensors([a], {"t": (1, 4)})
    with pytest.raises(C.InvalidShardsError, match=r"tensor 't': .* reach \[2, 4\], outside its shape \[8\]"):
        C.full_tensors([a], {"t": (8,)})
    with pytest.raises(C.InvalidShardsError, match=r"the shard files hold tensors \[\] the export has not and lack "
                                                   r"\['u'\] of it \(1 in all\); a rank's shard file is missing"):
        C.full_tensors([a], {"t": (2, 4), "u": (1,)})


@pytest.mark.parametrize("blocks, overlap", [
    ([((0, c), (4, 1)) for c in range(1000)], None),  # 1,000 columns (Shard(1) on as many ranks)
    ([((0, c), (4, 1)) for c in range(998)] + [((0, 997), (4, 3))], (997, 998)),
    ([((2 * r, 2 * c), (2, 2)) for r in range(3) for c in range(3)], None),  # a grid
    ([((2 * r, 2 * c), (2, 2)) for r in range(3) for c in range(3)] + [((3, 3), (1, 1))], (4, 9)),
    ([((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))], None),  # pinwheel
    ([((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((0, 0), (1, 1))], (0, 4)),
    ([((0, 0), (2, 4)), ((1, 0), (0, 4)), ((2, 0), (2, 4))], None),  # a block of no elements overlaps nothing
    ([((), ()), ((), ())], (0, 1)),  # a scalar held twice
])
def test_full_tensors_find_any_two_blocks_that_overlap(blocks, overlap):
    """Blocks sharded along any dimension, a grid, a pinwheel (no straight cut splits it): two
    blocks sharing an element (`overlap`: their places in `blocks`) are found and named, files
    included, whatever the layout."""
    group = [C.Block("t", "F32", offsets, shape, f"s{i}") for i, (offsets, shape) in enumerate(blocks)]
    if overlap is None:
        C.full_tensors(group)
        return
    a, b = (group[i] for i in overlap)
    with pytest.raises(C.InvalidShardsError, match=re.escape(
            f"tensor 't': blocks at offsets {list(a.offsets)} ({a.src}) and {list(b.offsets)} ({b.src}) overlap")):
        C.full_tensors(group)


# --- real DCP shard input ----------------------------------------------------------------------


def dcp_shards(tmp_path, state, mapping) -> str:
    folder = str(tmp_path / "sharded")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(folder, fqn_to_index_mapping=mapping,
                                                            save_distributed=True))
    return folder


def test_consolidates_dcp_shards_bit_identical_with_index(tmp_path):
    state = full_state()
    shards = dcp_shards(tmp_path, state, MAPPING)
    out = str(tmp_path / "hf")
    C.consolidate_safetensors(shards, out, MAPPING, remove_shards=True)
    assert_identical(read_output(out), state)
    index = json.load(open(os.path.join(out, C.INDEX_FILE)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert index["weight_map"]["ids"] == "model-00002-of-00003.safetensors"
    for i in (1, 2, 3):
        assert_aligned(os.path.join(out, model_file_name(i, 3)))
    assert not os.path.exists(shards)  # shards removed after success


def test_shards_kept_by_default_and_no_mapping_gives_one_file(tmp_path):
    state = full_state()
    shards = dcp_shards(tmp_path, state, None)
    out = str(tmp_path / "hf")
    C.consolidate_safetensors(shards, out, num_threads=3)
    assert sorted(os.listdir(out)) == sorted([C.INDEX_FILE, "model-00001-of-00001.safetensors"])
    assert_identical(read_output(out), state)
    assert os.listdir(shards)


def test_an_output_file_that_is_a_link_is_replaced_not_written_through(tmp_path):
    """An output folder downloaded with links into a hub cache (`model-*.safetensors` -> a blob
    other folders share): the export replaces the link with its own file and leaves the blob."""
    state = full_state()
    shards = dcp_shards(tmp_path, state, None)
    out = tmp_path / "hf"
    out.mkdir()
    blob = tmp_path / "cache-blob"
    blob.write_bytes(b"weights another folder links to")
    os.symlink(blob, out / "model-00001-of-00001.safetensors")
    C.consolidate_safetensors(shards, str(out))
    assert blob.read_bytes() == b"weights another folder links to"
    assert not os.path.islink(out / "model-00001-of-00001.safetensors")
    assert_identical(read_output(str(out)), state)


def test_inner_dim_uneven_shards_stream_through_a_small_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "CHUNK_BYTES", 24)  # forces chunks that end inside runs
    g = torch.Generator().manual_seed(1)
    full = {"a": torch.randn(5, 7, generator=g), "b": torch.randint(0, 9, (3, 4, 5), generator=g),
            "c": torch.randn(4, 6, 5, generator=g).bfloat16(), "d": torch.rand(6, 3, generator=g) > 0.5,
            "s": torch.tensor(7, dtype=torch.int32)}
    write_shards(str(tmp_path / "in"), full, {"a": 1, "b": 2, "c": 1, "d": 0}, [0.3, 0.8])
    C.consolidate_safetensors(str(tmp_path / "in"), str(tmp_path / "out"), num_threads=2)
    assert_identical(read_output(str(tmp_path / "out")), full)


def test_matches_pytorch_consolidation_on_the_same_shards(tmp_path):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    full = {"a": torch.randn(5, 7), "b": torch.randn(4, 6).bfloat16()}
    write_shards(str(tmp_path / "in"), full, {"a": 1, "b": 0}, [0.5])
    os.makedirs(tmp_path / "theirs")
    consolidate_safetensors_files_on_every_rank(str(tmp_path / "in"), str(tmp_path / "theirs"), {"a": 1, "b": 1})
    C.consolidate_safetensors(str(tmp_path / "in"), str(tmp_path / "ours"))
    theirs = load_file(str(tmp_path / "theirs" / "model-00001-of-00001.safetensors"))  # no index single-process
    assert_identical(read_output(str(tmp_path / "ours")), theirs)
    assert_identical(theirs, full)


# --- corrupted input ---------------------------------------------------------------------------


def shard_path(tmp_path, r: int) -> str:
    return str(tmp_path / "in" / f"shard-{r:05d}-model-00001-of-00001.safetensors")


@pytest.mark.parametrize("damage, match", [
    ("truncate", "header of .* bytes in a file of 20 bytes"),
    ("drop_shard", "cover 15 of 35 elements"),
    ("dtype", "has dtype 'Q7'"),
    ("plain", "not a DCP HF shard file"),
    ("short_data", "claims bytes"),
])
def test_corrupt_shards_raise_naming_the_file(tmp_path, damage, match):
    write_shards(str(tmp_path / "in"), {"a": torch.randn(5, 7)}, {"a": 1}, [0.5])
    path = shard_path(tmp_path, 1)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "truncate":
        raw = raw[:20]
    elif damage == "drop_shard":
        os.remove(path)  # the files alone do not say the full shape, so drop a leading block
        path = shard_path(tmp_path, 2)
    elif damage == "dtype":
        raw = raw.replace(b'"F32"', b'"Q7" ')
    elif damage == "plain":
        save_file({"a": torch.zeros(2)}, path)
        raw = open(path, "rb").read()
    elif damage == "short_data":
        raw = raw[:8 + n + 4]
    if damage != "drop_shard":
        open(path, "wb").write(raw)
    with pytest.raises(C.InvalidShardsError, match=match) as info:
        C.consolidate_safetensors(str(tmp_path / "in"), str(tmp_path / "out"))
    assert isinstance(info.value, CorruptCheckpointError)
    assert os.path.basename(path) in str(info.value)
    assert not os.path.exists(os.path.join(tmp_path, "out", C.INDEX_FILE))


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None])
def test_a_shard_whose_dtype_is_not_a_name_is_refused_naming_the_file(tmp_path, dtype):
    os.makedirs(tmp_path / "in")
    path = shard_path(tmp_path, 1)
    text = json.dumps({"__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})},
                       "w": {"dtype": dtype, "shape": [4], "data_offsets": [0, 16]}}).encode()
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + bytes(16))
    with pytest.raises(C.InvalidShardsError, match=re.escape(f"{path}: tensor 'w' has dtype {dtype!r}; known: ")):
        C.consolidate_safetensors(str(tmp_path / "in"), str(tmp_path / "out"))


def test_a_consolidation_replaces_the_model_files_of_an_earlier_one(tmp_path):
    """Into a folder holding an earlier consolidation of more files, the earlier model files go
    (left, they would make a folder that an import refuses); other files stay."""
    from torchtitan_ckpt.hf.load import read_hf_layout

    state = full_state()
    shards = dcp_shards(tmp_path, state, None)
    out = tmp_path / "hf"
    C.consolidate_safetensors(shards, str(out), MAPPING)
    (out / "consolidated.safetensors").write_bytes(b"another format's")
    (out / "notes.txt").write_text("mine")
    C.consolidate_safetensors(shards, str(out), {**MAPPING, "scale": 1, "h": 2})
    assert sorted(os.listdir(out)) == ["consolidated.safetensors", model_file_name(1, 2), model_file_name(2, 2),
                                       C.INDEX_FILE, "notes.txt"]
    assert_identical(read_output(str(out)), state)
    assert sorted(read_hf_layout(str(out))) == sorted(state)


def test_only_files_named_as_dcp_shards_are_consolidated(tmp_path, caplog):
    """Another `.safetensors` file among the shards (a stray copy, a user's) is left out, with a
    log line naming it, as a two-phase export's clearing leaves it: consolidated, its tensors
    would join the output. A folder holding no shard named so names what it holds."""
    state = full_state()
    shards = dcp_shards(tmp_path, state, None)
    save_file({"stray": torch.ones(2)}, os.path.join(shards, "stray.safetensors"),
              metadata={"DCP_SHARDING_INFO": json.dumps({"stray": {"saved_offsets": [0]}})})
    with caplog.at_level("INFO", logger=C.__name__):
        C.consolidate_safetensors(shards, str(tmp_path / "hf"))
    assert_identical(read_output(str(tmp_path / "hf")), state)
    assert (f"{shards}: ignoring ['stray.safetensors'], not named as DCP's shard files are "
            "(shard-0000R-model-0000X-of-0000N.safetensors)") in caplog.messages
    only = tmp_path / "only"
    only.mkdir()
    os.rename(os.path.join(shards, "stray.safetensors"), only / "stray.safetensors")
    with pytest.raises(C.InvalidShardsError, match=rf"^{only}: no shard files \(shard-0000R-model-0000X-of-0000N"
                                                   r"\.safetensors\); \['stray.safetensors'\] are not named so$"):
        C.consolidate_safetensors(str(only), str(tmp_path / "out"))


def test_missing_input_folder_is_a_clear_error(tmp_path):
    with pytest.raises(C.InvalidShardsError, match="no such folder"):
        C.consolidate_safetensors(str(tmp_path / "nope"), str(tmp_path / "out"))


# --- one-pass export and CLI -------------------------------------------------------------------


def test_one_pass_export_single_process(tmp_path):
    state = full_state()
    C.write_safetensors_one_pass(state, str(tmp_path / "hf"), MAPPING)
    assert_identical(read_output(str(tmp_path / "hf")), state)
    assert_aligned(os.path.join(tmp_path, "hf", model_file_name(1, 3)))
    with pytest.raises(ValueError, match="'step' is a int"):
        C.write_safetensors_one_pass({"step": 3}, str(tmp_path / "x"))


def test_one_pass_writes_a_non_contiguous_tensor_in_its_logical_order(tmp_path):
    """A non-contiguous tensor is written in its logical order, and a block whose bytes two of
    the 4 threads share (359 bytes in all) is whole in the file."""
    state = {**full_state(), "t": torch.arange(24.0).reshape(4, 6).t()}
    C.write_safetensors_one_pass(state, str(tmp_path / "hf"), {**MAPPING, "t": 1}, num_threads=4)
    assert_identical(read_output(str(tmp_path / "hf")), {k: v.contiguous() for k, v in state.items()})


def _held(fqn: str, offsets: tuple[int, ...], shape: tuple[int, ...], full: tuple[int, ...], dtype: str = "F32"):
    return C.Block(fqn, dtype, offsets, shape), full


def test_pipeline_ranks_agree_on_the_tensors_in_the_models_order_and_on_one_writer_per_block():
    """Rank 0 holds stages 0 and 2 (layers 0 and 2), rank 1 stages 1 and 3; a norm is replicated
    on ranks 1 and 2, the embedding sharded over ranks 0 and 2."""
    every = [[_held("emb", (0, 0), (4, 8), (8, 8)), _held("l0", (0,), (8,), (8,)), _held("l2", (0,), (8,), (8,))],
             [_held("l1", (0,), (8,), (8,)), _held("l3", (0,), (8,), (8,)), _held("norm", (0,), (8,), (8,))],
             [_held("emb", (4, 0), (4, 8), (8, 8)), _held("norm", (0,), (8,), (8,))]]
    assert list(C.agreed_specs(every)) == ["emb", "l0", "l2", "l1", "l3", "norm"]
    specs = C.agreed_specs(every, ["emb", "l0", "l1", "l2", "l3", "norm"])
    assert list(specs) == ["emb", "l0", "l1", "l2", "l3", "norm"] and specs["emb"].shape == (8, 8)
    assert C.writers(every) == {("emb", (0, 0)): 0, ("l0", (0,)): 0, ("l2", (0,)): 0, ("l1", (0,)): 1,
                                ("l3", (0,)): 1, ("norm", (0,)): 1, ("emb", (4, 0)): 2}
    every[2][1] = _held("norm", (0,), (8,), (8,), "BF16")
    with pytest.raises(ValueError, match=r"'norm' is BF16 \[8\] on rank 2 and F32 \[8\] on a lower rank"):
        C.agreed_specs(every)


def test_cli_consolidates_with_a_mapping_file(tmp_path, capsys):
    state = full_state()
    shards = dcp_shards(tmp_path, state, MAPPING)
    json.dump(MAPPING, open(tmp_path / "map.json", "w"))
    assert cli.main(["consolidate", shards, str(tmp_path / "hf"), "--mapping", str(tmp_path / "map.json"),
                     "--num-threads", "2"]) == 0
    assert_identical(read_output(str(tmp_path / "hf")), state)
    assert not os.path.exists(str(tmp_path / "hf") + cli.PARTIAL_SUFFIX)
    assert cli.main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(str(tmp_path / "o") + cli.PARTIAL_SUFFIX)


@pytest.mark.parametrize("mapping, problem", [
    ({"weight_map": {"w": "model.safetensors"}}, "'w' maps to 'model.safetensors'; expected a numbered model file"),
    ({"weight_map": {"w": "consolidated"}}, "'w' maps to 'consolidated'; expected a numbered model file"),
    ({"weight_map": {"w": 3}}, "'w' maps to 3; expected a numbered model file"),
    ({"weight_map": {"w": "model-00000-of-00002.safetensors"}}, "'w' maps to 'model-00000-of-00002.safetensors'"),
    ({"w": "x"}, "'w' maps to 'x'; expected a file index (an integer from 1)"),
    ({"w": 0}, "'w' maps to 0; expected a file index (an integer from 1)"),
    ({"w": [1] * 10000}, "'w' maps to [1, 1, 1, 1, 1, 1, ...]; expected a file index"),
    ({"weight_map": [1]}, "expected an object, {fqn: file index}, or an HF index with a weight_map"),
    ([1, 2], "expected an object, {fqn: file index}, or an HF index with a weight_map"),
])
def test_a_mapping_file_that_is_not_one_is_refused_naming_the_entry(tmp_path, capsys, mapping, problem):
    shards = dcp_shards(tmp_path, full_state(), None)
    (tmp_path / "map.json").write_text(json.dumps(mapping))
    assert cli.main(["consolidate", shards, str(tmp_path / "hf"), "--mapping", str(tmp_path / "map.json")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'map.json'}: {problem}" in err and len(err) < 1000
    assert not os.path.exists(tmp_path / "hf")


def test_a_mapping_file_is_read_from_an_hf_index_and_within_a_bound(tmp_path, monkeypatch):
    index = {"metadata": {}, "weight_map": {"w": model_file_name(2, 3), "emb": model_file_name(1, 3)}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert C.load_mapping(str(tmp_path / "index.json")) == {"w": 2, "emb": 1}
    monkeypatch.setattr(C, "MAX_INDEX_BYTES", 16)
    with pytest.raises(ValueError, match=r"index.json: larger than 16 bytes, far more than any file mapping"):
        C.load_mapping(str(tmp_path / "index.json"))


def test_an_interrupted_export_stops_its_copy_threads_before_it_raises(tmp_path, monkeypatch):
    """Ctrl-C reached the calling thread, which raised at once while the copy threads went on
    writing (a `convert` run again into the same folder got the interrupted run's bytes)."""
    import signal
    import threading
    import time

    monkeypatch.setattr(C, "CHUNK_BYTES", 4096)
    calls = []

    def progress(nbytes, total):
        calls.append(nbytes)
        if len(calls) == 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.002)

    before = set(threading.enumerate())
    state = {f"t{i}": torch.full((256, 64), float(i)) for i in range(16)}  # 256 chunks
    # SIGINT as a terminal delivers it: a shell ignores it in what it starts in the background
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            C.write_safetensors_one_pass(state, str(tmp_path / "hf"), num_threads=2, progress=progress)
    finally:
        signal.signal(signal.SIGINT, handler)
    seen = len(calls)
    time.sleep(0.3)
    assert not set(threading.enumerate()) - before and len(calls) == seen < 256
