"""Property-based bad input: random and mutated TOML, overrides, commit markers and DCP metadata
end in our own error with a message, never an unrelated traceback or a hang."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import pickle
import shutil
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_ckpt import CheckpointError, ConfigError, CorruptCheckpointError, cli, commit
from torchtitan_ckpt.example.config import load_job_config
from torchtitan_ckpt.dcp import storage
from torchtitan_ckpt.dcp.metadata import MAX_METADATA_BYTES, METADATA_FILE, read_metadata
from torchtitan_ckpt.config import sections
from torchtitan_ckpt.example.config import JobConfig

from .helpers import DEBUG_CONFIG, within

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)  # the same examples every run: CI fails on a change, not on a draw
BOUND = 20
"""Seconds one example may take (a hang fails the test instead of stalling it)."""

with open(DEBUG_CONFIG, "rb") as f:
    TOML = f.read()

KEYS = [f"{name}.{key}" for name, cls in sections(JobConfig).items() for key in cls.__dataclass_fields__]
VALUES = st.one_of(st.text(max_size=12), st.integers(-3, 10**6).map(str), st.sampled_from(
    ["true", "false", "-1", "0", "1e9", "none", "", "a,b", "model", "nan", "inf"]))


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        out[pos % len(out)] = byte
    return bytes(out)


@FAST
@given(st.lists(st.tuples(st.integers(0, len(TOML) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_toml_is_loaded_or_refused_with_a_config_error(tmp_path, edits):
    with within(BOUND):
        path = tmp_path / "job.toml"
        path.write_bytes(_mutate(TOML, edits))
        try:
            load_job_config(path)
        except ConfigError as e:
            assert str(e)


@FAST
@given(st.lists(st.tuples(st.sampled_from(KEYS + ["checkpoint.nope", "nope.x"]), VALUES), max_size=4))
def test_random_overrides_are_accepted_or_refused_naming_the_key(pairs):
    with within(BOUND):
        argv = [a for key, value in pairs for a in (f"--{key}", value)]
        try:
            load_job_config(DEBUG_CONFIG, argv)
        except ConfigError as e:
            assert e.key and str(e).startswith(e.key)


@FAST
@given(st.binary(max_size=400))
def test_random_bytes_as_a_commit_marker(tmp_path, data):
    with within(BOUND):
        (tmp_path / commit.MARKER).write_bytes(data)
        try:
            info = commit.read_marker(str(tmp_path))
        except CheckpointError as e:
            assert commit.MARKER in str(e)
        else:
            assert isinstance(info, commit.CommitInfo)


@FAST
@given(st.dictionaries(st.sampled_from(["step", "states", "files", "format", "world_size", "x"]),
                       st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2))))
def test_json_markers_of_the_wrong_shape(tmp_path, raw):
    with within(BOUND):
        (tmp_path / commit.MARKER).write_text(json.dumps(raw))
        try:
            commit.read_marker(str(tmp_path))
        except CheckpointError as e:
            assert commit.MARKER in str(e)


@functools.cache
def _real_metadata() -> bytes:
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as path:
        dcp.save({"w": torch.ones(3), "n": 1}, storage_writer=storage.make_storage_writer(path))
        with open(os.path.join(path, METADATA_FILE), "rb") as f:
            return f.read()


@functools.cache
def _real_safetensors() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
                 "c": torch.tensor(True)})


def _read_mutated(tmp_path, original: bytes, edits, cut, name: str, read):
    """Write `original`, mutated and cut short, as `name`; `read` it: either it returns, or it
    raises our own error naming the file. Returns what it read (None when refused) and the bytes."""
    data = _mutate(original, edits)[: max(1, cut % (len(original) + 1))]
    path = tmp_path / name
    path.write_bytes(data)
    try:
        return read(str(path)), data
    except CheckpointError as e:
        assert str(path) in str(e)
        return None, data


MUTATIONS = {"edits": st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
             "cut": st.integers(0, 10**6)}


@FAST
@given(**MUTATIONS)
def test_mutated_dcp_metadata_is_read_or_refused(tmp_path, edits, cut):
    with within(BOUND):
        _read_mutated(tmp_path, _real_metadata(), edits, cut, ".metadata", read_metadata)


def test_pickled_code_in_metadata_never_runs(tmp_path):
    evidence = tmp_path / "ran"
    for payload in [(os.system, (f"touch {evidence}",)), (shutil.rmtree, (str(tmp_path / "x"),)),
                    (eval, ("1",)), (pickle.loads, (b"",))]:
        class Evil:
            def __reduce__(self, payload=payload):
                return payload

        path = tmp_path / "md"
        path.write_bytes(pickle.dumps(Evil()))
        try:
            read_metadata(str(path))
        except CheckpointError as e:
            assert "refusing to load it" in str(e)
        else:
            raise AssertionError(f"{payload[0]} was accepted")
    assert not evidence.exists()


def test_metadata_of_a_newer_pytorch_is_refused_as_such_not_as_damaged(tmp_path, monkeypatch):
    """PyTorch 2.15 pickles `TensorProperties` with a sixth field (its strides), which 2.13
    cannot unpack: that says which PyTorch to load with, not that the file is damaged."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    metadata = pickle.loads(_real_metadata())  # our own file, as PyTorch reads it
    older = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*older(self), None))
    path = tmp_path / METADATA_FILE
    path.write_bytes(pickle.dumps(metadata))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"was written by a newer PyTorch than this one \(.*\): its "
                                              r"TensorProperties holds more fields .*Load it with the PyTorch") as e:
        read_metadata(str(path))
    assert type(e.value) is CheckpointError

    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: older(self)[:4])  # fewer: damaged
    path.write_bytes(pickle.dumps(metadata))
    monkeypatch.undo()
    with pytest.raises(CorruptCheckpointError, match=r"is not a readable DCP metadata file: .*not enough values"):
        read_metadata(str(path))


@dataclasses.dataclass
class Attribute:
    """Pickled as `getattr(cls, name)`, as some Pythons pickle an enum member (tests/test_other_versions.py)."""
    cls: type
    name: object


class _Attributes(pickle.Pickler):
    def reducer_override(self, obj):
        return (getattr, (obj.cls, obj.name)) if isinstance(obj, Attribute) else NotImplemented


@pytest.mark.parametrize("cls, name", [("memory format", "__class__"), ("memory format", "TORCH_NOPE"),
                                       ("memory format", 1), ("size", "mro"), ("size", "__subclasses__")])
def test_a_getattr_in_metadata_names_only_a_member_of_dcps_enums(tmp_path, cls, name):
    import torch
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    cls = {"memory format": _MEM_FORMAT_ENCODING, "size": torch.Size}[cls]
    path = tmp_path / METADATA_FILE
    out = io.BytesIO()
    _Attributes(out, protocol=4).dump({"x": Attribute(cls, name)})
    path.write_bytes(out.getvalue())
    with pytest.raises(CorruptCheckpointError, match=rf"^{path}: its pickle asks for the attribute .* of .*, where a "
                                                     "DCP metadata file names only members of DCP's enums"):
        read_metadata(str(path))


def test_a_metadata_file_that_is_no_pickle_is_refused_before_it_is_read_whole(tmp_path):
    """A sparse file just under the size bound: it was read whole (1 GiB in memory) before its
    first byte was looked at."""
    path = tmp_path / METADATA_FILE
    os.truncate(path.touch() or path, MAX_METADATA_BYTES - 1)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"is not a DCP metadata file: it starts with b'\\x00'"):
            read_metadata(str(path))
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


@FAST
@given(**MUTATIONS)
def test_mutated_safetensors_headers_are_read_or_refused(tmp_path, edits, cut):
    with within(BOUND):
        from torchtitan_ckpt.hf.safetensors_io import read_header

        entries, data = _read_mutated(tmp_path, _real_safetensors(), edits, cut, "model.safetensors", read_header)
        if entries is not None:  # what it accepts is consistent with the file
            assert sum(e.nbytes for e in entries.values()) <= len(data)


def test_safetensors_header_claiming_more_than_the_file(tmp_path):
    import struct

    from torchtitan_ckpt.hf.safetensors_io import read_header

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    try:
        read_header(str(path))
    except CheckpointError as e:
        assert "exceeds the file" in str(e)
    else:
        raise AssertionError("accepted")


@pytest.mark.parametrize("header, data, library_refuses, problem", [
    ('{"z": {"dtype": "F32", "shape": [1], "data_offsets": [0, NaN]}}', 4, True,
     "the header holds NaN, which is not JSON"),
    ('{"z": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"a": Infinity}}', 4, True,
     "the header holds Infinity"),
    ('{"z": {"dtype": "F32", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}', 0, True,
     "spans more than the"),
    ('{"z": {"dtype": "F32", "shape": [0, 4611686018427387904, 4], "data_offsets": [0, 0]}}', 0, False,
     "spans more than the"),
])
def test_a_safetensors_header_of_what_no_tensor_or_json_holds_is_refused(tmp_path, header, data, library_refuses,
                                                                          problem):
    """Found by fuzzing: Python's `json` reads NaN and Infinity, which the `safetensors` library
    refuses as not JSON; a 0 in a shape hid dimensions no tensor can have (the library refuses
    2**64, a u64's overflow; `torch.empty` refuses both, and failed later naming neither file
    nor tensor)."""
    import struct

    from safetensors import SafetensorError, safe_open

    from torchtitan_ckpt.hf.safetensors_io import read_header

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * data)
    with contextlib.nullcontext() if not library_refuses else pytest.raises(SafetensorError):
        with safe_open(str(path), "pt") as f:
            assert [f.get_slice(k).get_shape() for k in f.keys()] == [[0, 2**62, 4]]
    with pytest.raises(CorruptCheckpointError, match=rf"^{path} is not a readable safetensors file: .*{problem}"):
        read_header(str(path))


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ".."])
def test_index_names_that_escape_the_folder_are_refused(tmp_path, file):
    from torchtitan_ckpt.hf.adapter import read_index

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": file}}))
    with pytest.raises(CheckpointError, match="not a file of this folder"):
        read_index(str(index))


# A fresh copy per draw: the tests edit inside what they insert, and a shared `{}` would carry
# one example's edits (even a reference to itself) into the next.
ODD_VALUES = st.sampled_from([None, -1, 0, 2**70, 1.5, "x", "../x", "/etc/passwd", [], [1, 2], {}, [[3]],
                              ("a",)]).map(copy.deepcopy)
METADATA_FIELDS = ["state_dict_metadata", "storage_data", "storage_meta", "w.size", "w.chunks", "w.properties",
                   "w.properties.dtype", "w.chunk.offsets", "w.chunk.sizes", "w.storage.relative_path",
                   "w.storage.offset", "w.storage.length", "n.storage.length", "n.storage.relative_path", "key"]


def _set_metadata_field(md, field: str, value) -> None:
    w = md.state_dict_metadata["w"]
    storage_of = {i.fqn: info for i, info in md.storage_data.items()}
    owners = {"w": w, "w.properties": w.properties, "w.chunk": w.chunks[0], "w.storage": storage_of["w"],
              "n.storage": storage_of["n"]}
    if field == "key":
        md.state_dict_metadata[value if isinstance(value, (int, float, str, type(None))) else 7] = w
        return
    owner, _, name = field.rpartition(".")
    setattr(owners[owner] if owner else md, name, value)


@FAST
@given(st.lists(st.tuples(st.sampled_from(METADATA_FIELDS), ODD_VALUES), min_size=1, max_size=3))
def test_dcp_metadata_with_fields_of_the_wrong_type_or_range(tmp_path, edits):
    """Inspecting or loading a folder whose `.metadata` has odd field values is our error or a load."""
    with within(BOUND):
        import torch
        import torch.distributed.checkpoint as dcp

        folder = tmp_path / "step"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        dcp.save({"w": torch.ones(3), "n": 1}, storage_writer=storage.make_storage_writer(str(folder)))
        md = read_metadata(str(folder / METADATA_FILE))
        for field, value in edits:
            with contextlib.suppress(KeyError, AttributeError, TypeError, IndexError):  # an earlier edit removed it
                _set_metadata_field(md, field, value)
        (folder / METADATA_FILE).write_bytes(pickle.dumps(md))
        state = {"w": torch.zeros(3), "n": None}
        try:  # as the manager loads: `.metadata` read and checked first, then what it has handed to the reader
            checked = read_metadata(str(folder / METADATA_FILE))
            state = {k: v for k, v in state.items() if k in checked.state_dict_metadata}
            storage.load_on_this_rank(state, storage.make_storage_reader(str(folder), checked),
                                      storage.make_load_planner())
        except CheckpointError as e:
            assert str(folder) in str(e)
        except BaseException as e:  # DCP wraps a reader's failure in its CheckpointException
            cause = storage.root_cause(e)
            assert isinstance(cause, CheckpointError) and str(folder) in str(cause), repr(cause)
        else:
            assert torch.equal(state.get("w", torch.ones(3)), torch.ones(3)) and state.get("n", 1) == 1
        assert cli.main(["inspect", str(folder)]) in (0, 2)  # a report, or our error: never a raw one


@FAST
@given(st.lists(st.tuples(st.sampled_from(["step", "states", "files", "format", "world_size", "created",
                                           "version", "files.entry", "files.name"]), ODD_VALUES),
                min_size=1, max_size=3))
def test_commit_markers_with_fields_of_the_wrong_type_or_range(tmp_path, edits):
    """`verify` and `list` of a real step whose marker has odd field values: our error, or a check
    of its files."""
    with within(BOUND):
        step = tmp_path / "ck" / "step-1"
        step.mkdir(parents=True, exist_ok=True)
        (step / "data").write_bytes(b"123")
        raw = {"step": 1, "states": ["model"], "format": "dcp", "world_size": 1, "created": 0.0, "version": 2,
               "files": {"data": {"size": 3, "crc32": "884863d2"}}}
        for field, value in edits:
            if field == "files.entry":
                raw["files"] = {"data": value}
            elif field == "files.name":
                raw["files"] = {str(value): {"size": 3, "crc32": "884863d2"}}
            else:
                raw[field] = value
        (step / commit.MARKER).write_text(json.dumps(raw))
        try:
            problems = commit.verify(str(step))
        except CheckpointError as e:
            assert commit.MARKER in str(e)
            listed = 1  # the step listed as corrupt: nothing loadable
        else:
            assert all(str(step) in p for p in problems)
            cut = any(p.endswith(": missing") or "bytes, the manifest says" in p for p in problems)  # cut_short
            listed = int(commit.read_marker(str(step)).step != 1 or cut)  # one naming another step is misnamed
        assert cli.main(["list", str(tmp_path / "ck")]) == listed


# ---------------------------------------------------------------- Hugging Face headers and index


HEADER_FIELDS = ["a.dtype", "a.shape", "a.data_offsets", "a", "b.shape", "b.data_offsets", "__metadata__",
                 "__metadata__.format"]


@FAST
@given(st.lists(st.tuples(st.sampled_from(HEADER_FIELDS), ODD_VALUES), min_size=1, max_size=3))
def test_safetensors_headers_with_fields_of_the_wrong_type_or_range(tmp_path, edits):
    """A header JSON whose fields hold odd values is our error naming the file, or entries that
    fit the file's data."""
    import struct

    from torchtitan_ckpt.hf.safetensors_io import read_header

    with within(BOUND):
        header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                  "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}, "__metadata__": {"format": "pt"}}
        for field, value in edits:
            owner, _, name = field.rpartition(".")
            with contextlib.suppress(TypeError, AttributeError, KeyError):  # an earlier edit replaced the owner
                (header[owner] if owner else header)[name] = value
        text = json.dumps(header).encode()
        path = tmp_path / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 32)
        try:
            entries = read_header(str(path))
        except CheckpointError as e:
            assert str(path) in str(e)
        else:
            assert all(e.offset + e.nbytes <= os.path.getsize(path) for e in entries.values())


INDEX_FIELDS = ["weight_map", "weight_map.a", "weight_map.b", "weight_map.new", "metadata", "top"]


@FAST
@given(st.lists(st.tuples(st.sampled_from(INDEX_FIELDS), ODD_VALUES), max_size=3),
       st.lists(st.tuples(st.integers(0, 10**4), st.integers(0, 255)), max_size=4))
def test_hf_index_with_odd_fields_or_bytes_is_read_or_refused(tmp_path, edits, flips):
    """`model.safetensors.index.json` with odd field values, then odd bytes, next to a real
    safetensors file: the folder's layout, or our error naming the folder or the index."""
    from torchtitan_ckpt.hf.load import read_hf_layout

    with within(BOUND):
        folder = tmp_path / "hf"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(_real_safetensors())
        index = {"metadata": {"total_size": 32},
                 "weight_map": {"a": "model.safetensors", "b": "model.safetensors", "c": "model.safetensors"}}
        for field, value in edits:
            owner, _, name = field.rpartition(".")
            with contextlib.suppress(TypeError, AttributeError, KeyError):  # an earlier edit replaced the owner
                if field == "top":
                    index = value
                elif owner:
                    index[owner][name] = value
                else:
                    index[name] = value
        data = json.dumps(index).encode()
        (folder / "model.safetensors.index.json").write_bytes(_mutate(data, flips) if flips else data)
        try:
            layout = read_hf_layout(str(folder))
        except CheckpointError as e:
            assert str(folder) in str(e)
        else:
            assert set(layout) <= {"a", "b", "c"}


TOML_VALUES = st.sampled_from(["[1]", "{ a = 1 }", "1979-05-27", "07:32:00", '"x"', "-1", "0", "1e400", "nan",
                               "-inf", "true", "9" * 40, "[[1]]", '"\\u0000"', '""', "[]", "{}", "0x10",
                               '"../../etc"', "3.5"])


@FAST
@given(st.lists(st.tuples(st.sampled_from(KEYS + ["checkpoint.nope"]), TOML_VALUES), min_size=1, max_size=4))
def test_toml_values_of_any_type_are_loaded_or_refused_naming_the_key(tmp_path, pairs):
    """A job TOML whose keys hold values of any TOML type: loaded, or a `ConfigError` naming a
    key of the file."""
    with within(BOUND):
        sections_of: dict[str, list[str]] = {}
        for key, value in pairs:
            section, name = key.split(".", 1)
            sections_of.setdefault(section, []).append(f"{name} = {value}")
        path = tmp_path / "job.toml"
        path.write_text("".join(f"[{s}]\n" + "\n".join(dict.fromkeys(lines)) + "\n" for s, lines in sections_of.items()))
        try:
            load_job_config(path)
        except ConfigError as e:
            assert e.key and str(e).startswith(e.key)
