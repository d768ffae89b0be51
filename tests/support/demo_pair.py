"""What the engine image holds at /opt/specdeploy/demo (Dockerfile.engine), built here: the tiny
target (with its tokenizer) and EAGLE draft whose config.json files are those of
manifests/examples/tiny-cpu-demo.yaml, field for field, with weights that make drafts accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMAGE_DEMO_DIR = "/opt/specdeploy/demo"
TINY_CPU_DEMO = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu-demo.yaml"
# Small enough that the toy target's next token follows its input often, so drafts get accepted.
TOY_LAYER_SCALE = 0.2


def build_demo_pair(root: Path, example: dict[str, Any]) -> Path:
    """root/target and root/draft for the example resource's inline configs; -> root."""
    from specdeploy.engine.demo import train
    from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config

    tc, dc = example["spec"]["target"]["config"], example["spec"]["draft"]["config"]
    cfg = tiny_config(
        vocab_size=tc["vocab_size"], hidden_size=tc["hidden_size"], intermediate_size=tc["intermediate_size"],
        num_layers=tc["num_hidden_layers"], num_heads=tc["num_attention_heads"],
        num_kv_heads=tc["num_key_value_heads"], head_dim=tc["head_dim"],
        max_position_embeddings=tc["max_position_embeddings"], rms_norm_eps=tc["rms_norm_eps"],
        rope_theta=tc["rope_theta"], tie_word_embeddings=tc["tie_word_embeddings"],
    )
    target, perm = predictable_target(cfg, seed=0, layer_scale=TOY_LAYER_SCALE)
    draft = copy_draft("EAGLE", target, perm, layer_scale=TOY_LAYER_SCALE)
    texts = list(train.read_corpus(train.corpus_files(300_000, roots=[Path(train.__file__).parent])))
    tok = train.train_tokenizer(texts, vocab_size=tc["vocab_size"])
    assert (tok.token_to_id(train.BOS_TOKEN), tok.token_to_id(train.EOS_TOKEN)) == (tc["bos_token_id"], tc["eos_token_id"])
    train.save_model(target, tc, root / "target")
    train.save_tokenizer(tok, root / "target")
    train.save_model(draft, dc, root / "draft", prefix="")
    return root
