"""A LoRA checkpoint out as PEFT reads it (``hpctrain ckpt export RUN --adapters DIR``), or
merged into its base (``--merged FILE``).

``--adapters`` needs neither the base nor a rebuilt model: the checkpoint's base record holds
each adapter's ``adapter_config.json`` and PEFT's file name of every trained tensor (PEFT's
own ``get_peft_model_state_dict`` computed them when the run saved), so the folder is what
``PeftModel.save_pretrained`` writes: ``adapter_model.safetensors`` + ``adapter_config.json``
(an adapter other than ``default`` in a subfolder of its name, as PEFT lays them out).
``--merged`` loads the base (the adapter config's ``base_model_name_or_path``, or ``--base``)
with the transformers class PEFT picks for the adapter's ``task_type``, checks it against the
checkpoint's digest of the base, loads the adapters with ``PeftModel.from_pretrained`` and
writes ``merge_and_unload()``'s weights one tensor at a time.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from hpctrain.core.atomic import atomic_write_text
from hpctrain.core.errors import UserError
from hpctrain.weights.export import Written, check_suffix, dict_source, write_stream
from hpctrain.weights.frozen import BaseMismatchError, base_digest, read_base_record
from hpctrain.weights.locate import checkpoint_source

DEFAULT = "default"  # PEFT's first adapter: its files at the folder's top


class AdapterExportError(UserError):
    """The checkpoint holds no PEFT adapters, or the base for ``--merged`` cannot be found."""


def _adapters(path: Path) -> dict[str, Any]:
    record = read_base_record(path)
    adapters = (record or {}).get("adapters")
    if not isinstance(adapters, dict) or not adapters:
        what = "a whole model (nothing frozen)" if record is None else "a frozen base, but no PEFT adapters"
        raise AdapterExportError(f"checkpoint {path} holds {what}; hint: --adapters and --merged export a PEFT "
                                 "model's LoRA checkpoint; `hpctrain ckpt export RUN OUT.safetensors` exports the rest")
    return adapters


def _trained(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (the trained ones and the buffers: small), by checkpoint name."""
    source = checkpoint_source(path)
    return {spec.name: tensor for spec, tensor in zip(source.specs, source.tensors, strict=True)
            if tensor is not None}


def write_adapters(path: Path, out: Path) -> list[Written]:
    """Every adapter of the checkpoint at ``path`` as PEFT's files under ``out``."""
    tensors = _trained(path)
    written = []
    for name, entry in sorted(_adapters(path).items()):
        folder = out if name == DEFAULT else out / name
        files: dict[str, str] = entry["files"]
        state = {peft_name: tensors[ours] for ours, peft_name in files.items() if ours in tensors}
        if len(state) != len(files):
            raise AdapterExportError(f"checkpoint {path} lacks {len(files) - len(state)} tensors of adapter {name!r} "
                                     "(crafted or damaged); hint: `hpctrain ckpt verify` it")
        written.append(write_stream(folder / "adapter_model.safetensors", dict_source(state)))
        atomic_write_text(folder / "adapter_config.json", entry["config"] + "\n")
    return [w for w in written if w is not None]


def write_merged(path: Path, out: Path, base: Path | None = None) -> Written:
    """The base with the checkpoint's adapters merged in (``merge_and_unload``), one file."""
    check_suffix(out)
    adapters = _adapters(path)
    if len(adapters) != 1:
        raise AdapterExportError(f"checkpoint {path} holds {len(adapters)} adapters ({', '.join(sorted(adapters))}): "
                                 "--merged merges one; hint: export them with --adapters and merge the one you want")
    config = json.loads(next(iter(adapters.values()))["config"])
    base_dir = base or Path(str(config.get("base_model_name_or_path") or ""))
    if not base_dir.is_dir():
        raise AdapterExportError(f"--merged needs the base model's folder: {base_dir or 'none'} (the adapter's "
                                 "base_model_name_or_path) is not a directory; hint: pass --base DIR")
    model = _peft_model(path, base_dir, config)
    merged = model.merge_and_unload()
    written = write_stream(out, dict_source(merged.state_dict()))
    assert written is not None  # write=True
    return written


def _peft_model(path: Path, base_dir: Path, config: dict[str, Any]) -> Any:
    """The base from ``base_dir`` (checked against the checkpoint's digest) with the adapters loaded."""
    try:
        from peft import PeftModel
    except ImportError:
        raise AdapterExportError("--merged loads the adapters with PEFT, which is not installed; hint: pip install "
                                 "peft (--adapters needs no PEFT)") from None
    base = _base_class(config).from_pretrained(str(base_dir))
    with tempfile.TemporaryDirectory(prefix="hpctrain-adapters-") as tmp:
        write_adapters(path, Path(tmp))
        model = PeftModel.from_pretrained(base, tmp)
        trained = set(_trained(path))
        names = [n for n, _ in model.named_parameters() if n not in trained]
        record = read_base_record(path) or {}
        if base_digest(model, names) != record.get("sha256"):
            raise BaseMismatchError(f"--merged: the base in {base_dir} is not the one checkpoint {path} was trained on "
                                    "(its frozen parameters' sha256 differs); hint: pass the training's base with "
                                    "--base DIR")
    return model


def _base_class(config: dict[str, Any]) -> Any:
    """The transformers class PEFT's own auto classes load a ``task_type``'s base with."""
    import peft.auto as auto

    task = config.get("task_type")
    wanted = auto.MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(task) if task else None
    for cls in vars(auto).values():
        target = getattr(cls, "_target_class", None)
        peft_class = getattr(cls, "_target_peft_class", None)
        if target is not None and wanted is not None and getattr(peft_class, "__name__", None) == wanted.__name__:
            return target
    raise AdapterExportError(f"--merged: the adapter's task_type {task!r} names no transformers class PEFT loads "
                             "bases with; hint: set task_type in the LoraConfig (e.g. CAUSAL_LM), or merge by hand "
                             "(PeftModel.from_pretrained(base, DIR).merge_and_unload())")
