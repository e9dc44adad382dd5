"""py-spy's raw stacks, only the samples under a frame matching argv[2]: the frames with the
most samples, inclusive (once per sample) and as the leaf (self), as % of those samples."""
import collections, re, sys

incl, leaf, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if sys.argv[2] not in stack:
        continue
    n = int(n)
    total += n
    frames = [re.sub(r"/[^ ]*/(site-packages|ostinato|python3\.12)/", r"\1/", f) for f in stack.split(";")]
    frames = [re.sub(r":\d+\)", ")", f) for f in frames]
    for f in set(frames):
        incl[f] += n
    leaf[frames[-1]] += n
print(f"{total} samples under {sys.argv[2]}")
for title, c in (("inclusive", incl), ("self", leaf)):
    print(f"--- {title}")
    for f, n in c.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 50):
        print(f"{n / total:6.1%} {n:6d}  {f[:180]}")
