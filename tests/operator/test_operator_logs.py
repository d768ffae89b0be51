"""`kubectl logs` of the operator reads as a history for people: one line per decision at INFO,
kopf's own bookkeeping at DEBUG, each phase change once, no flicker at creation."""

from __future__ import annotations

import re

from testcluster import wait_for


def test_a_resource_to_ready_and_a_refusal_are_a_few_lines(kube_cluster, kube_namespace, operator_process,
                                                           hub_secret, manifest, sdd_of, capsys):
    operator = operator_process(metrics_interval_s=0)

    def wait_log(text: str, what: str) -> None:
        try:
            wait_for(lambda: text in operator.logs(), timeout_s=30, what=what)
        except TimeoutError as err:  # the log so far says which line is missing and what came instead
            raise AssertionError(f"{err}\n--- operator log ---\n{operator.logs()}") from err

    wait_log("starting:", "the operator's first line")
    kube_cluster.apply(manifest("tidy", replicas=1), namespace=kube_namespace)
    sdd_of("tidy").wait_ready()
    kube_cluster.apply(manifest("wrongpair", draft={"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}),
                       namespace=kube_namespace)
    wait_log("DraftIncompatible", "the refusal in the log")
    wait_log("-> Ready (", "the phase line")
    logs = operator.logs()
    with capsys.disabled():
        print("\n" + logs)
    lines = [line for line in logs.splitlines() if line.strip()]
    for chatter in ("Handler '", "is processed", "Activity '", "authentication", "HTTP Request:", "Traceback",
                    "OS signals"):
        assert not any(chatter in line for line in lines), (chatter, logs)
    tidy = [line for line in lines if f"[{kube_namespace}/tidy]" in line]
    phases = [re.search(r"phase (\S+ -> \S+)", line).group(1) for line in tidy if "phase" in line]
    # each once, no flicker back (kwok's pods may be ready before the reconciler writes its status)
    assert phases in (["Planning -> Deploying", "Deploying -> Ready"], ["Planning -> Ready"]), logs
    refused = [line for line in lines if f"[{kube_namespace}/wrongpair]" in line]
    assert len(refused) == 1 and "hidden_size" in refused[0], logs    # once, not again as kopf's retry
    assert len(lines) <= 8, logs
