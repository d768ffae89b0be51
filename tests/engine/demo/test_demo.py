"""README's main command, shrunk: the demo's whole path (train, save, cache, serve, compare) with a
few training steps, so it cannot rot. Its numbers are meaningless at this size; the path is not."""

from __future__ import annotations

from specdeploy.engine.demo import cli as demo


def test_demo_trains_caches_serves_and_compares(tmp_path, capsys):
    recipe = demo.Recipe(corpus_bytes=200_000, vocab_size=300, hidden_size=32, num_layers=2, intermediate_size=64,
                         context_length=256, target_steps=3, draft_steps=3, num_target_generations=4)
    assert demo.run_demo(recipe, tmp_path, max_tokens=6) == 0
    first = capsys.readouterr().out
    for expected in ("tokenizer: byte-level BPE", "target: step 3/3", "draft: step 3/3", "completion",
                     "chat", "streamed", "mean acceptance length", "target only:",
                     "greedy outputs identical to target-only"):
        assert expected in first, f"{expected!r} missing from:\n{first}"
    # How to serve the pair without the demo, and the model id its clients send.
    assert f"--target {tmp_path / 'target'} --draft {tmp_path / 'draft'} --algorithm EAGLE" in first
    assert 'model "specdeploy-demo"' in first
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "target" / name).is_file()
    assert (tmp_path / "draft" / "model.safetensors").is_file()

    assert demo.run_demo(recipe, tmp_path, max_tokens=6) == 0
    second = capsys.readouterr().out
    assert "cached pair found" in second and "target: step" not in second
