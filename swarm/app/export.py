"""``swarm export STATE_DIR OUT_DIR``: a peer's final model in a form other tools load.

A Hugging Face model becomes a ``save_pretrained`` directory (``config.json`` + ``model.safetensors``) that
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads with the run's final θg; any other model becomes
``OUT_DIR/model.safetensors`` under the module's own ``state_dict`` names.

When the run's ``[data] tokenizer`` names a tokenizer.json (or ``--tokenizer`` gives one), it is copied in as
``tokenizer.json`` with a ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, the special tokens the file and
the model's config agree on), so that ``AutoTokenizer.from_pretrained(OUT_DIR)`` loads it too.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from swarm.config import ConfigError
from swarm.train.model.final_model import HF_CONFIG_KEY, RUN_SPEC_KEY

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL = ("bos", "eos", "pad")  # the HF config's <name>_token_id -> tokenizer_config's <name>_token


@dataclass
class Exported:
    weights: Path  # the weights file written
    tokenizer: Optional[Path] = None  # the tokenizer.json written, if any
    notes: list[str] = field(default_factory=list)  # one sentence each, for the user (stderr)


def final_model_path(state_dir: Path) -> Path:
    path = state_dir / "final" / "model.safetensors"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; give the --state-dir of a peer whose run finished.")
    return path


def export(state_dir: Path, out_dir: Path, *, tokenizer: Optional[Path] = None) -> Exported:
    """Write the export of ``state_dir``'s final model (and its tokenizer) into ``out_dir``. ``tokenizer``: a
    tokenizer.json to use instead of the one the run's ``[data] tokenizer`` names."""
    source = final_model_path(state_dir)
    with safe_open(str(source), framework="pt") as f:
        metadata = f.metadata() or {}
    data = _run_data(metadata)
    tokenizer_json = _tokenizer_source(data, state_dir, tokenizer)  # a missing --tokenizer is refused before writing
    tokens = _read_tokenizer(tokenizer_json) if tokenizer_json is not None else None
    tensors = load_file(str(source))
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = None
    if HF_CONFIG_KEY not in metadata:
        target = out_dir / "model.safetensors"
        save_file(tensors, str(target), metadata={"format": "pt"})
    else:
        from swarm.train.model.hf_model import model_from_config_json, save_pretrained

        model = model_from_config_json(metadata[HF_CONFIG_KEY])
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected or set(missing) - set(dict(model.named_buffers())):
            raise ConfigError(
                f"{source} does not fit the model its config describes ({(unexpected or missing)[0]!r});"
                " it was not written by swarm for this model."
            )
        hf_config = model.config
        if tokens is not None and len(tokens["vocab"]) > hf_config.vocab_size:
            raise ConfigError(
                f"{tokenizer_json} has {len(tokens['vocab'])} tokens, more than the model's vocabulary of"
                f" {hf_config.vocab_size}: it is not the run's tokenizer; give that one with --tokenizer."
            )
        save_pretrained(model, out_dir)
        target = out_dir / "model.safetensors"
    result = Exported(weights=target)
    if hf_config is not None:
        from swarm.train.model.hf_model import special_ids_outside_vocab

        problem = special_ids_outside_vocab(hf_config)
        if problem:
            result.notes.append(problem[0].upper() + problem[1:])
    if tokens is not None:
        result.tokenizer = _write_tokenizer(tokenizer_json, tokens, out_dir, hf_config)
    else:
        result.notes.append(_no_tokenizer_note(data))
    return result


def _run_data(metadata: dict[str, str]) -> Optional[dict[str, Any]]:
    """The run spec's [data] table as recorded in the final model (None: a file without the spec). Read as JSON,
    not checked as a config: the run's data files need not be on the machine that exports."""
    try:
        data = json.loads(metadata[RUN_SPEC_KEY]).get("data") if RUN_SPEC_KEY in metadata else None
    except (ValueError, AttributeError):
        return None
    return data if isinstance(data, dict) else None


def _tokenizer_source(data: Optional[dict[str, Any]], state_dir: Path, given: Optional[Path]) -> Optional[Path]:
    """The tokenizer.json to export: ``given``, else the run's ``[data] tokenizer`` found here (as named, or
    beside the peer's state dir), else None."""
    if given is not None:
        if not given.is_file():
            raise ConfigError(f"--tokenizer {given} does not exist; give the tokenizer.json the run was trained with.")
        return given
    name = str((data or {}).get("tokenizer") or "")
    if not name:
        return None
    path = Path(name).expanduser()
    places = [path] if path.is_absolute() else [path, state_dir.parent / path, state_dir / path]
    return next((p for p in places if p.is_file()), None)


def _read_tokenizer(path: Path) -> dict[str, Any]:
    """The tokenizer.json's vocabulary, special tokens (by id) and unk token."""
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
    except ImportError:
        raise ConfigError(
            "exporting the run's tokenizer needs Hugging Face tokenizers; install it with: "
            "pip install 'swarm-train[hf]'."
        ) from None
    except Exception as e:  # the Rust library raises plain Exception for a malformed file
        raise ConfigError(
            f"{path} is not a tokenizer.json Hugging Face tokenizers reads ({e}); give the run's "
            "tokenizer with --tokenizer."
        ) from None
    raw = json.loads(path.read_text(encoding="utf-8"))
    special = {t["id"]: t["content"] for t in raw.get("added_tokens") or [] if t.get("special")}
    unk = (raw.get("model") or {}).get("unk_token")
    return {"vocab": tokenizer.get_vocab(with_added_tokens=True), "special": special, "unk": unk}


def _write_tokenizer(source: Path, tokens: dict[str, Any], out_dir: Path, hf_config: Any) -> Path:
    """``tokenizer.json`` and a minimal ``tokenizer_config.json`` in ``out_dir``; special tokens are named where
    the model's config gives an id the tokenizer marks special (or the tokenizer's unk token)."""
    target = out_dir / TOKENIZER_FILE
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in _SPECIAL:
        token_id = getattr(hf_config, f"{name}_token_id", None) if hf_config is not None else None
        if isinstance(token_id, int) and token_id in tokens["special"]:
            config[f"{name}_token"] = tokens["special"][token_id]
    if tokens["unk"] and tokens["unk"] in tokens["vocab"]:
        config["unk_token"] = tokens["unk"]
    context = _context(hf_config)
    if context:
        config["model_max_length"] = context
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return target


def _context(hf_config: Any) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _no_tokenizer_note(data: Optional[dict[str, Any]]) -> str:
    """Why the export has no tokenizer, and how to add one, in one sentence."""
    if data is None:
        return (
            "The final model does not record its run's data, so the export has no tokenizer: add the one the run"
            " used with --tokenizer PATH/tokenizer.json."
        )
    if data.get("tokenizer"):
        return (
            f"The run's tokenizer {str(data['tokenizer'])!r} is not on this machine (looked as named and beside"
            " the state dir), so the export has no tokenizer: give it with --tokenizer PATH/tokenizer.json."
        )
    if data.get("tokens"):
        return (
            "The run trained on token files, which do not say what made them, so the export has no tokenizer: add"
            " the one that made them with --tokenizer PATH/tokenizer.json."
        )
    return (
        "The run read its text as bytes (no [data] tokenizer), so the export has no tokenizer: its token ids are"
        " the text's UTF-8 bytes (list(text.encode())); for a tokenizer, train the run with [data] tokenizer"
        " (scripts/train_tokenizer.py makes one)."
    )
