"""Does the deprecated ``rollout_id`` alias slow ``Sample`` attribute access?

Compares reads and writes of ordinary ``Sample`` fields on three classes built in this run:

- ``Sample``: vime's class, which defines the write-only ``rollout_id`` property;
- ``no alias``: the same slotted attrs fields (``attrs.make_class``) with no alias at all: the
  baseline;
- ``__getattribute__ alias``: the same fields with the alias done by overriding
  ``__getattribute__``, the pattern that taxes every access; it shows what overhead this
  benchmark can detect.

Each timing is one ``timeit`` of 8 field reads (or 2 writes) repeated ``number`` times; the
three classes are measured in interleaved rounds and the table prints medians over rounds and
the ratio to the baseline. A ratio within noise of 1.00 for ``Sample`` means the alias costs
nothing measurable.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.sample_access`` (``--quick`` for a
smoke run, ``--rounds N``, ``--number N``).
"""

import argparse
import statistics
import timeit

import attrs

from vime_pure import Sample

READS = ("s.tokens; s.group_id; s.reward; s.status; s.loss_mask; s.index; s.metadata; "
         "s.remove_sample")
WRITES = "s.group_id = 3; s.reward = 1.0"


def _fields() -> dict[str, attrs.Attribute]:
    return {f.name: attrs.field(default=f.default) for f in attrs.fields(Sample)}


def make_classes() -> dict[str, type]:
    plain = attrs.make_class("PlainSample", _fields(), slots=True)
    hooked = attrs.make_class("HookedSample", _fields(), slots=True)

    def __getattribute__(self, name):  # noqa: N807 - the naive alias being measured
        if name == "rollout_id":
            name = "group_id"
        return object.__getattribute__(self, name)

    hooked.__getattribute__ = __getattribute__
    return {"no alias (baseline)": plain, "Sample (property alias)": Sample,
            "__getattribute__ alias": hooked}


def measure(rounds: int, number: int) -> dict[str, dict[str, float]]:
    classes = make_classes()
    objs = {name: cls(tokens=[1, 2, 3], response_length=1, reward=0.5)
            for name, cls in classes.items()}
    times: dict[str, dict[str, list[float]]] = {n: {"read": [], "write": []} for n in classes}
    for _ in range(rounds):
        for name, obj in objs.items():  # interleaved, so drift hits every class alike
            for kind, stmt in (("read", READS), ("write", WRITES)):
                secs = timeit.Timer(stmt, globals={"s": obj}).timeit(number)
                times[name][kind].append(secs / number * 1e9)
    return {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in times.items()}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args(argv)
    rounds, number = (3, 2_000) if args.quick else (args.rounds, args.number)
    med = measure(rounds, number)
    base = med["no alias (baseline)"]
    print(f"medians over {rounds} rounds of {number} loops (ns per loop)")
    print(f"  {'class':26s} {'8 reads':>9s} {'ratio':>7s} {'2 writes':>9s} {'ratio':>7s}")
    for name, m in med.items():
        print(f"  {name:26s} {m['read']:9.1f} {m['read'] / base['read']:7.3f} "
              f"{m['write']:9.1f} {m['write'] / base['write']:7.3f}")
    ratio = med["Sample (property alias)"]["read"] / base["read"]
    print(f"alias overhead ratio (Sample / no alias, reads): {ratio:.3f}")
    return med


if __name__ == "__main__":
    main()
