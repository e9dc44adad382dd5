"""Summarise py-spy's raw (collapsed) stacks: the frames with the most samples, inclusive
(each sample counted once per frame) and as the leaf (self)."""
import collections, re, sys

incl, leaf, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    if not stack:
        continue
    n = int(n)
    total += n
    frames = [re.sub(r"/[^ ]*/(site-packages|ostinato|python3\.12)/", r"\1/", f) for f in stack.split(";")]
    frames = [re.sub(r":\d+\)", ")", f) for f in frames]  # a function, not a line
    for f in set(frames):
        incl[f] += n
    leaf[frames[-1]] += n
print(f"{total} samples")
for title, c in (("inclusive", incl), ("self", leaf)):
    print(f"--- {title}")
    for f, n in c.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 60):
        print(f"{n / total:6.1%} {n:6d}  {f[:200]}")
