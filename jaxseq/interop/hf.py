"""The Hugging Face GPT-2 format: `config.json` + `model.safetensors` ↔ a jaxseq config and parameter tree.

Pure NumPy (the `safetensors` NumPy API): converting needs neither torch nor JAX. Why a module of
its own: the tensor names and layouts belong to Hugging Face, and everything jaxseq cannot represent
is refused here, once, with one line naming it.

HF GPT-2's Conv1D stores weights as [in, out]; `c_attn` is [h, 3h] = Q | K | V, each split into heads,
which is exactly jaxseq's [h, 3, heads, head_dim] kernel reshaped.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from jaxseq.config import ConfigError, ModelConfig

QKV = ("q", "k", "v")  # GPT's attention weights (models/gpt.py), one c_attn tensor in Hugging Face's
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GPT-2's tanh GELU, which jaxseq computes
# Non-parameter tensors older checkpoints carry (causal-mask buffers): kept verbatim, never used.
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# Files of an HF directory carried through a conversion unchanged (tokenizer, generation settings).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt")


def safetensors_numpy():
    try:
        import safetensors.numpy as st
    except ImportError:
        raise ConfigError("the safetensors package is not installed (pip install -r requirements.txt)") from None
    return st


# ---------------------------------------------------------------------------------------------
# config.json ↔ ModelConfig


def model_config(hf: dict, dtype: str = "float32") -> ModelConfig:
    """The jaxseq model an HF GPT-2 config describes, or a ConfigError naming what does not fit."""
    def refuse(what):
        raise ConfigError(f"config.json: {what} is not supported by jaxseq")

    if hf.get("model_type") != "gpt2":
        refuse(f"model_type={hf.get('model_type')!r} (only 'gpt2')")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        refuse(f"activation_function={act!r} (only {' / '.join(ACTIVATIONS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag, False):
            refuse(f"{flag}=true")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights=false")
    if not hf.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings=false (untied embeddings)")
    try:
        h, heads, layers = int(hf["n_embd"]), int(hf["n_head"]), int(hf["n_layer"])
        vocab, positions = int(hf["vocab_size"]), int(hf["n_positions"])
    except KeyError as e:
        raise ConfigError(f"config.json: {e.args[0]} is missing") from None
    if h % heads:
        refuse(f"n_head={heads} not dividing n_embd={h}")
    inner = hf.get("n_inner") or 4 * h
    if inner % h:
        refuse(f"n_inner={inner} (must be a multiple of n_embd={h})")
    return ModelConfig(vocab_size=vocab, seq_len=positions, hidden=h, heads=heads, layers=layers,
                       mlp_ratio=inner // h, dropout=float(hf.get("resid_pdrop", 0.1)), dtype=dtype,
                       ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def hf_config(cfg: ModelConfig) -> dict:
    """A GPT-2 config.json for a jaxseq model (when no original config travelled with the weights)."""
    if cfg.kv_channels is not None and cfg.kv_channels * cfg.heads != cfg.hidden:
        raise ConfigError(f"kv_channels={cfg.kv_channels}: HF GPT-2 needs heads × head width = hidden")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden, "n_head": cfg.heads,
            "n_layer": cfg.layers, "n_inner": None if cfg.mlp_ratio == 4 else cfg.mlp_hidden,
            "layer_norm_epsilon": cfg.ln_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout, "tie_word_embeddings": True, "scale_attn_weights": True,
            "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1, "dtype": "float32"}


# ---------------------------------------------------------------------------------------------
# Reading: one tensor at a time


# The dtypes a GPT-2 parameter may have on disk (safetensors' codes).
PARAM_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class Weights:
    """The tensors of a local HF directory (`model.safetensors`, or the files a sharded checkpoint's
    `model.safetensors.index.json` names), read one at a time: names, shapes and dtypes come from the
    files' headers, a tensor's data (or a block of it) only when `read` asks for it."""

    def __init__(self, hf_dir: str, files: list[str]):
        from safetensors import safe_open

        self.names, self.shapes, self.codes, self.metadata, self._file = [], {}, {}, {}, {}
        for name in files:
            handle = safe_open(os.path.join(hf_dir, name), "np")
            self.metadata = handle.metadata() or self.metadata
            for key in handle.keys():
                view = handle.get_slice(key)
                self.names.append(key)
                self.shapes[key], self.codes[key], self._file[key] = tuple(view.get_shape()), view.get_dtype(), handle
        if "BF16" in self.codes.values():
            # registers NumPy's "bfloat16", which safetensors' NumPy API reads into
            importlib.import_module("ml_dtypes")

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """The tensor `name`, or only its block `index` (a tuple of slices): the file's bytes of that block."""
        # safetensors refuses an empty slice that starts at a dimension's end; one at 0 is the same block.
        index = tuple(s if len(range(n)[s]) else slice(0, 0) for n, s in zip(self.shapes[name], index))
        return self._file[name].get_slice(name)[index]


def read_dir(hf_dir: str) -> tuple[dict, Weights]:
    """(config dict, the weights, read lazily) of a local HF GPT-2 directory; no network."""
    config = read_config(hf_dir)
    model_config(config)  # refuse before reading gigabytes
    return config, open_weights(hf_dir)


def read_config(hf_dir: str) -> dict:
    """The config.json of a local HF directory, or a ConfigError when there is none."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir!r} has no config.json (not a Hugging Face model directory)")
    return json.load(open(cfg_path))


def open_weights(hf_dir: str) -> Weights:
    """The tensors of a local HF directory, one file or the sharded layout's index, read lazily."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
        files = [SINGLE]
    else:
        raise ConfigError(f"{hf_dir!r} has no {SINGLE} (re-save with save_pretrained(safe_serialization=True))")
    safetensors_numpy()  # the library, or a one-line error
    return Weights(hf_dir, files)


def _prefix(weights: Weights) -> str:
    """'transformer.' as GPT2LMHeadModel saves; '' as GPT2Model (and the original OpenAI upload) saves."""
    for p in ("transformer.", ""):
        if p + "wte.weight" in weights:
            return p
    raise ConfigError("model.safetensors has no wte.weight (not a GPT-2 checkpoint)")


def _layer_names(p: str, i: int) -> dict[str, str]:
    b = f"{p}h.{i}."
    return {"ln1.scale": b + "ln_1.weight", "ln1.bias": b + "ln_1.bias", "ln2.scale": b + "ln_2.weight",
            "ln2.bias": b + "ln_2.bias", "qkv.kernel": b + "attn.c_attn.weight", "qkv.bias": b + "attn.c_attn.bias",
            "out.kernel": b + "attn.c_proj.weight", "out.bias": b + "attn.c_proj.bias",
            "wi.kernel": b + "mlp.c_fc.weight", "wi.bias": b + "mlp.c_fc.bias",
            "wo.kernel": b + "mlp.c_proj.weight", "wo.bias": b + "mlp.c_proj.bias"}


@dataclass(frozen=True)
class Leaf:
    """One jaxseq parameter as HF tensors hold it, read on demand: `read(index)` is the block `index` (a
    tuple of slices of `shape`) in float32, reading only the HF tensors that block needs, one at a time."""

    shape: tuple[int, ...]
    read: Callable[[tuple], np.ndarray]

    def whole(self) -> np.ndarray:
        return self.read(tuple(slice(0, n) for n in self.shape))


def tensor_leaf(weights: Weights, name: str) -> Leaf:
    return Leaf(weights.shapes[name], lambda idx: np.asarray(weights.read(name, idx), np.float32))


def _stacked(weights: Weights, names: list[str], layer_shape: tuple[int, ...]) -> Leaf:
    """[L, *layer_shape] from one HF tensor per layer (each reshaped). A tensor that keeps its shape (the MLP
    kernels, LayerNorms, biases) is read only in the block asked for; a reshaped one (qkv, out) whole."""
    def block(name, idx):
        if weights.shapes[name] == layer_shape:
            return weights.read(name, idx)
        return np.asarray(weights.read(name)).reshape(layer_shape)[idx]

    def read(idx):
        layers = range(len(names))[idx[0]]
        return np.stack([np.asarray(block(names[i], idx[1:]), np.float32) for i in layers])

    return Leaf((len(names), *layer_shape), read)


def _part(leaf: Leaf, axis: int, index: int) -> Leaf:
    """Entry `index` of `axis` of a leaf, that axis dropped: Q, K or V of GPT-2's one c_attn tensor per layer."""
    def read(idx):
        return np.take(leaf.read(idx[:axis] + (slice(index, index + 1),) + idx[axis:]), 0, axis=axis)

    return Leaf(leaf.shape[:axis] + leaf.shape[axis + 1:], read)


@dataclass(frozen=True)
class _Joined:
    """Stacked leaves [L, …] joined along a new `axis` of each layer, layer by layer: GPT-2's c_attn from Q, K, V."""

    parts: tuple
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        first = tuple(self.parts[0].shape)
        return first[:self.axis + 1] + (len(self.parts),) + first[self.axis + 1:]

    def __getitem__(self, i):
        return np.stack([np.asarray(part[i], np.float32) for part in self.parts], axis=self.axis)


def _qkv_sources(attn: dict) -> dict:
    """c_attn's kernel [L, h, 3, a, d] and bias [L, 3, a, d]: the fused leaves, or Q, K and V joined."""
    if "qkv" in attn:
        return {"qkv.kernel": attn["qkv"]["kernel"], "qkv.bias": attn["qkv"]["bias"]}
    return {"qkv.kernel": _Joined(tuple(attn[name]["kernel"] for name in QKV), axis=1),
            "qkv.bias": _Joined(tuple(attn[name]["bias"] for name in QKV), axis=0)}


def to_params(cfg: ModelConfig, weights: Weights) -> tuple[dict, dict, dict]:
    """HF tensors → (jaxseq params as `Leaf`s, read on demand, the record to-hf needs to write them back,
    buffers). The token embedding keeps its vocab_size rows; padding it for a mesh is the reader's job.

    Everything that can be refused is refused here, from the headers (names, shapes, dtypes), before any
    weight is read, but for the tied lm_head, compared with wte.weight. The record holds the key prefix,
    each tensor's dtype and the order, so that from-hf → to-hf reproduces every tensor exactly.
    """
    p, h, a, d, L = _prefix(weights), cfg.hidden, cfg.heads, cfg.head_dim, cfg.layers
    used = {p + "wte.weight", p + "wpe.weight", p + "ln_f.weight", p + "ln_f.bias"}
    expect = {p + "wte.weight": (cfg.vocab_size, h), p + "wpe.weight": (cfg.seq_len, h), p + "ln_f.weight": (h,),
              p + "ln_f.bias": (h,)}

    def stack(key, shape):
        names = [_layer_names(p, i)[key] for i in range(L)]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ConfigError(f"model.safetensors has no {missing[0]} (n_layer={L} in config.json)")
        expect.update({n: math.prod(shape) for n in names})
        used.update(names)
        return _stacked(weights, names, shape)

    ln = lambda k: {"scale": stack(f"{k}.scale", (h,)), "bias": stack(f"{k}.bias", (h,))}
    qkv_kernel, qkv_bias = stack("qkv.kernel", (h, 3, a, d)), stack("qkv.bias", (3, a, d))  # c_attn: [h, 3h], [3h]
    params = {
        "embed": {"token": tensor_leaf(weights, p + "wte.weight"), "position": tensor_leaf(weights, p + "wpe.weight")},
        "layers": {
            "ln1": ln("ln1"),
            "attn": {**({"qkv": {"kernel": qkv_kernel, "bias": qkv_bias}} if cfg.fused_qkv else
                        {name: {"kernel": _part(qkv_kernel, 2, c), "bias": _part(qkv_bias, 1, c)}
                         for c, name in enumerate(QKV)}),
                     "out": {"kernel": stack("out.kernel", (a, d, h)), "bias": stack("out.bias", (h,))}},
            "ln2": ln("ln2"),
            "mlp": {"wi": {"kernel": stack("wi.kernel", (h, cfg.mlp_hidden)),
                           "bias": stack("wi.bias", (cfg.mlp_hidden,))},
                    "wo": {"kernel": stack("wo.kernel", (cfg.mlp_hidden, h)), "bias": stack("wo.bias", (h,))}},
        },
        "final_ln": {"scale": tensor_leaf(weights, p + "ln_f.weight"), "bias": tensor_leaf(weights, p + "ln_f.bias")},
    }
    check_params(weights, expect, used)
    if "lm_head.weight" in weights:
        if not np.array_equal(weights.read("lm_head.weight"), weights.read(p + "wte.weight")):
            raise ConfigError("lm_head.weight differs from wte.weight (untied embeddings) is not supported by jaxseq")
        used.add("lm_head.weight")
    buffers, record = leftovers(weights, used, BUFFER_SUFFIXES)
    return params, {"prefix": p, **record, "lm_head": "lm_head.weight" in weights}, buffers


def leftovers(weights: Weights, used: set, buffer_suffixes: tuple[str, ...]) -> tuple[dict, dict]:
    """(buffers, record) once the parameters are `used`: the other tensors are buffers, kept verbatim, when
    their names end with buffer_suffixes, and refused otherwise; the record keeps the names' order and every
    tensor's dtype, so that writing back reproduces each tensor exactly."""
    extra = [n for n in weights.names if n not in used]
    unknown = [n for n in extra if not n.endswith(buffer_suffixes)]
    if unknown:
        raise ConfigError(f"model.safetensors holds {unknown[0]}, which jaxseq cannot represent")
    buffers = {n: weights.read(n) for n in extra}
    dtypes = {n: PARAM_DTYPES[weights.codes[n]] for n in weights.names if n not in buffers}
    return buffers, {"order": list(weights.names),
                     "dtypes": {**dtypes, **{n: str(b.dtype) for n, b in buffers.items()}}}


def check_params(weights: Weights, expect: dict, used: set) -> None:
    """Every parameter tensor present with the shape (or, per layer, the size) the config gives, and a dtype
    jaxseq reads."""
    for name in sorted(used):
        if name not in weights:
            raise ConfigError(f"model.safetensors has no {name}")
        want, got = expect.get(name), weights.shapes[name]
        if (isinstance(want, tuple) and got != want) or (isinstance(want, int) and math.prod(got) != want):
            raise ConfigError(f"{name} has shape {got}, config.json says {want}")
        if weights.codes[name] not in PARAM_DTYPES:
            raise ConfigError(f"{name} has dtype {weights.codes[name]}, which jaxseq cannot represent")


# ---------------------------------------------------------------------------------------------
# Writing: one tensor at a time, one file or Hugging Face's sharded layout


class Tensor(NamedTuple):
    """One HF tensor to write: its shape and dtype, and how to compute it (called once, when written)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    load: Callable[[], np.ndarray]


def from_params(cfg: ModelConfig, params: dict, record: dict | None = None,
                buffers: dict[str, np.ndarray] | None = None) -> dict[str, Tensor]:
    """jaxseq params → HF tensors, each computed when written; with the record of a from-hf conversion, the
    original names, order and dtypes. A params leaf is anything with a shape whose `[i]` (layer i of a
    stacked leaf) and `np.asarray` give host arrays: NumPy, or a sharded array's host view (convert.py)."""
    record = record or {"prefix": "transformer.", "lm_head": False}
    p, h, L = record["prefix"], cfg.hidden, cfg.layers
    f32 = lambda a: np.asarray(a, np.float32)
    lay = params["layers"]
    token = params["embed"]["token"]
    tensors = {p + "wte.weight": ((cfg.vocab_size, h), lambda: f32(token)[: cfg.vocab_size]),
               p + "wpe.weight": unstacked(params["embed"]["position"]),
               p + "ln_f.weight": unstacked(params["final_ln"]["scale"]),
               p + "ln_f.bias": unstacked(params["final_ln"]["bias"])}
    sources = {"ln1.scale": lay["ln1"]["scale"], "ln1.bias": lay["ln1"]["bias"], "ln2.scale": lay["ln2"]["scale"],
               "ln2.bias": lay["ln2"]["bias"],
               **_qkv_sources(lay["attn"]),
               "out.kernel": lay["attn"]["out"]["kernel"],
               "out.bias": lay["attn"]["out"]["bias"], "wi.kernel": lay["mlp"]["wi"]["kernel"],
               "wi.bias": lay["mlp"]["wi"]["bias"], "wo.kernel": lay["mlp"]["wo"]["kernel"],
               "wo.bias": lay["mlp"]["wo"]["bias"]}
    names = [_layer_names(p, i) for i in range(L)]
    for key, stacked in sources.items():
        # Kernels back to Conv1D's [in, out]: qkv [h, 3, a, d] → [h, 3h], out [a, d, h] → [a·d, h].
        size = math.prod(stacked.shape[1:])
        shape = {"qkv.kernel": (h, size // h), "out.kernel": (size // h, h)}.get(
            key, (size,) if not key.endswith("kernel") else tuple(stacked.shape[1:]))
        for i in range(L):
            tensors[names[i][key]] = (shape, lambda s=stacked, i=i, shape=shape: f32(s[i]).reshape(shape))
    if record.get("lm_head"):
        tensors["lm_head.weight"] = tensors[p + "wte.weight"]
    return as_tensors(tensors, record, buffers)


def as_tensors(tensors: dict, record: dict, buffers: dict[str, np.ndarray] | None = None) -> dict[str, Tensor]:
    """{name: (shape, load)} and the buffers as `Tensor`s in the record's order and dtypes (float32 and
    sorted names without one); a name the record's order lacks comes last."""
    tensors = {**tensors, **{n: (b.shape, lambda b=b: b) for n, b in (buffers or {}).items()}}
    dtypes = record.get("dtypes", {})
    order = [n for n in record.get("order") or sorted(tensors) if n in tensors]
    order += sorted(n for n in tensors if n not in order)
    return {n: Tensor(tuple(tensors[n][0]), _dtype(dtypes.get(n, "float32")), tensors[n][1]) for n in order}


def unstacked(x) -> tuple[tuple[int, ...], Callable[[], np.ndarray]]:
    return tuple(x.shape), lambda: np.asarray(x, np.float32)


SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def write_dir(out: str, config: dict, tensors: dict[str, Tensor], metadata: dict | None = None,
              max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """config.json and the tensors, one at a time: `model.safetensors`, or, over max_shard_bytes (decimal,
    as `save_pretrained`'s max_shard_size), Hugging Face's sharded layout: model-0000i-of-0000n.safetensors
    in the tensors' order plus model.safetensors.index.json. Returns the files written."""
    os.makedirs(out, exist_ok=True)
    for stale in [n for n in os.listdir(out) if n in (SINGLE, INDEX) or _SHARD_FILE.fullmatch(n)]:
        os.remove(os.path.join(out, stale))  # another layout's files would shadow or mix with these
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    groups = _shard_groups(tensors, max_shard_bytes)
    files = [SINGLE] if len(groups) == 1 else [f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                                               for i in range(1, len(groups) + 1)]
    for name, group in zip(files, groups):
        _write_file(os.path.join(out, name), {n: tensors[n] for n in group}, metadata or {"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
                 "weight_map": {n: f for f, group in zip(files, groups) for n in group}}
        with open(os.path.join(out, INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return files


_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _nbytes(t: Tensor) -> int:
    return math.prod(t.shape) * np.dtype(t.dtype).itemsize


def _shard_groups(tensors: dict[str, Tensor], max_bytes: int) -> list[list[str]]:
    """The tensors in order, a new file whenever the next would take this one past max_bytes (a tensor
    larger than max_bytes gets a file of its own), as `save_pretrained` splits."""
    groups, size = [[]], 0
    for name, t in tensors.items():
        if groups[-1] and size + _nbytes(t) > max_bytes:
            groups, size = groups + [[]], 0
        groups[-1].append(name)
        size += _nbytes(t)
    return groups


def _write_file(path: str, tensors: dict[str, Tensor], metadata: dict) -> None:
    """A safetensors file written one tensor at a time. The library lays the file out (header, order,
    alignment) from specs that all point at one zero buffer; each tensor is then computed and written at
    the offsets the header gives, so the bytes equal `safetensors.numpy.save_file` of the same tensors."""
    import safetensors

    zeros = np.zeros(max((_nbytes(t) for t in tensors.values()), default=0), np.uint8)
    specs = {n: safetensors.TensorSpec(dtype=np.dtype(t.dtype).name, shape=t.shape, data_ptr=zeros.ctypes.data,
                                       data_len=_nbytes(t)) for n, t in tensors.items()}
    safetensors.serialize_file(specs, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())  # the library creates its files 0600; these follow the umask like config.json
    del zeros
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        for name, t in tensors.items():
            data = np.ascontiguousarray(t.load().astype(t.dtype, copy=False))
            begin, end = header[name]["data_offsets"]
            if data.shape != t.shape or data.nbytes != end - begin:
                raise ValueError(f"{name}: computed {data.shape} {data.dtype}, declared {t.shape} {t.dtype}")
            f.seek(8 + header_len + begin)
            f.write(memoryview(data.reshape(-1).view(np.uint8)))


def _umask() -> int:
    """The process's umask (reading it means setting it: put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def copy_side_files(src: str, dst: str, names=SIDE_FILES) -> list[str]:
    """Copy the tokenizer and config files that exist in `src`; returns the names copied."""
    import shutil

    os.makedirs(dst, exist_ok=True)
    copied = [n for n in names if os.path.isfile(os.path.join(src, n))]
    for n in copied:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    return copied

