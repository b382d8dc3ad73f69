import sys

import onnx

src, dst = sys.argv[1:3]
m = onnx.load(src)
g = m.graph
nodes = [onnx.NodeProto() for _ in g.node]
for a, b in zip(nodes, g.node):
    a.CopyFrom(b)
rename = {}
keep = []
for n in nodes:
    if n.op_type == "Add" and len(n.input) == 2 and n.input[0].endswith("_nbits") and n.input[1].endswith("_corr"):
        rename[n.output[0]] = n.input[0]
    else:
        keep.append(n)
for n in keep:
    for i, x in enumerate(n.input):
        if x in rename:
            n.input[i] = rename[x]
used = {o.name for o in g.output}
alive = []
for n in reversed(keep):
    if any(o in used for o in n.output if o):
        alive.append(n)
        used.update(n.input)
alive.reverse()
print("nodes", len(nodes), "->", len(alive), "renamed", len(rename))
del g.node[:]
g.node.extend(alive)
onnx.save(m, dst)
