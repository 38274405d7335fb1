"""Reproduces the Ray bug behind ``ObjectStoreTransport.keeps_frame_until_released``: an
``ObjectRef`` put by an actor and yielded, inside a list, by its streaming generator (as Serve
returns every reply) can lose its reference count before a third process fetches it
(ray-project/ray#58080). With ``--hold`` the producer keeps its own reference, as our prefill
replicas do now, and every fetch succeeds.

    python scripts/ray_nested_ref_repro.py            # some fetches fail (ReferenceCountingAssertionError)
    python scripts/ray_nested_ref_repro.py --hold     # none do

Prints how many of the fetches failed; exits 0 either way (timing decides how many)."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="the producer keeps a reference to what it yielded")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--items", type=int, default=100, help="items a round's generator yields")
    args = parser.parse_args(argv)

    import numpy as np
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")

    @ray.remote
    class Producer:
        def __init__(self, hold: bool) -> None:
            self.hold = hold
            self.held: list = []

        async def frames(self, n: int):
            for i in range(n):
                ref = ray.put(np.full(200_000, i % 251, dtype=np.uint8))
                if self.hold:
                    self.held.append(ref)
                yield [ref]  # nested, as a ticket's handle

    @ray.remote
    class Consumer:
        async def first_byte(self, refs: list) -> int | str:
            try:
                return int((await refs[0])[0])
            except Exception as exc:  # noqa: BLE001 - what the fetch raised is the result
                return type(exc).__name__

    producer, consumer = Producer.remote(args.hold), Consumer.remote()
    failures: dict[str, int] = {}
    total = 0
    t0 = time.monotonic()
    for _ in range(args.rounds):
        pending = []
        for item in producer.frames.options(num_returns="streaming").remote(args.items):
            pending.append(consumer.first_byte.remote(ray.get(item)))  # the driver borrows, then passes on
        for i, out in enumerate(ray.get(pending)):
            total += 1
            if out != i % 251:
                failures[str(out)] = failures.get(str(out), 0) + 1
    ray.shutdown()
    print(f"hold={args.hold}: {sum(failures.values())} of {total} fetches failed {failures or ''} "
          f"in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
