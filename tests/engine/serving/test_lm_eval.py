"""EleutherAI's lm-evaluation-harness against the server (its local-completions backend: token
prompts, echo + logprobs for log-likelihoods, stop strings for generation), on two small local
tasks, gives what the same harness gives on the transformers model of the same weights: the
same log-likelihoods (float32, under speculation), the same choices and the same generations."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

# The corpus the tiny tokenizer was trained on is this package's code: continuations of it.
CHOICE_DOCS = [
    {"context": "def main(", "choices": [")", "self", "x, y"], "gold": 0},
    {"context": "import os\nimport", "choices": [" sys", " torch", " json"], "gold": 1},
    {"context": "class Runner:", "choices": ["\n    def", " pass", "(object)"], "gold": 0},
    {"context": "return torch.", "choices": ["zeros", "ones", "cat"], "gold": 2},
    {"context": "for i in", "choices": [" range(", " list(", " x"], "gold": 0},
]
GEN_DOCS = [{"prompt": p, "answer": ""} for p in ("def main(", "import os\n", "class A:", "x = torch.", "# the ")]


def write_tasks(root) -> None:
    (root / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CHOICE_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "tiny_choice.yaml").write_text(f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
""")


def evaluate(model: str, model_args: str, root):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["tiny_choice", "tiny_gen"],
                          task_manager=TaskManager(include_path=str(root)), log_samples=True, batch_size=1,
                          device="cpu")
    samples = out["samples"]
    # (log-likelihood, whether the continuation is the greedy one) per choice of each document
    lls = [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]]
           for s in sorted(samples["tiny_choice"], key=lambda s: s["doc_id"])]
    gens = [s["resps"][0][0] for s in sorted(samples["tiny_gen"], key=lambda s: s["doc_id"])]
    return out["results"]["tiny_choice"]["acc,none"], lls, gens


def test_the_harness_scores_the_server_as_the_transformers_model(server, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # local files only
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path)
    target = model_dirs[0]
    # add_bos_token on both: the two backends' defaults differ (the API one adds none).
    served = evaluate("local-completions", f"model={server.model},base_url={server.url}/v1/completions,"
                      f"tokenizer_backend=huggingface,tokenizer={target},num_concurrent=1,max_retries=1,add_bos_token=True", tmp_path)
    reference = evaluate("hf", f"pretrained={target},dtype=float32,add_bos_token=True", tmp_path)
    acc, lls, gens = served
    want_acc, want_lls, want_gens = reference
    assert acc == want_acc
    assert len(lls) == len(CHOICE_DOCS)
    for got, want in zip(lls, want_lls):
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)
        assert [g for _, g in got] == [g for _, g in want]
    assert gens == want_gens
    assert any(g for g in gens)  # something was generated
