"""A sampling profiler for `specdeploy operator` (py-spy is not installed on the dev machine).

Put this folder first on PYTHONPATH and set SPECDEPLOY_PROFILE_OUT=<file>: every 5 ms it reads
the stack of each of the operator's threads, skips those waiting (select, lock, socket read,
sleep), and every 5 s rewrites <file> with the most frequent frames, inclusive and leaf. The file
survives a SIGKILL (the scale test's teardown). docs/reliability.md, "Where the time goes".
"""

import os
import sys

if "operator" in sys.argv and os.environ.get("SPECDEPLOY_PROFILE_OUT"):
    import collections
    import threading
    import time

    _OUT = os.environ["SPECDEPLOY_PROFILE_OUT"]
    _WAITING = {"select", "poll", "epoll", "wait", "acquire", "recv_into", "recv", "read", "_worker", "sleep",
                "get", "readinto", "accept"}

    def _sample() -> None:
        me, inclusive, leaf = threading.get_ident(), collections.Counter(), collections.Counter()
        samples = busy = 0
        written = time.monotonic()
        while True:
            time.sleep(0.005)
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                samples += 1
                if frame.f_code.co_name in _WAITING:
                    continue
                busy += 1
                leaf[f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1
                seen = set()
                while frame is not None:
                    key = f"{'/'.join(frame.f_code.co_filename.split('/')[-2:])}:{frame.f_code.co_name}"
                    if key not in seen:
                        seen.add(key)
                        inclusive[key] += 1
                    frame = frame.f_back
            if time.monotonic() - written > 5:
                written = time.monotonic()
                with open(_OUT, "w") as out:
                    out.write(f"samples {samples} busy {busy}\n== inclusive\n")
                    out.writelines(f"{n:7d} {k}\n" for k, n in inclusive.most_common(70))
                    out.write("== leaf\n")
                    out.writelines(f"{n:7d} {k}\n" for k, n in leaf.most_common(40))

    threading.Thread(target=_sample, daemon=True, name="stack-sampler").start()
