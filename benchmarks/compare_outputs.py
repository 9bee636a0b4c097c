"""Two output folders of zckpt compared file by file, apart from what is random or dated by design: torch zips
entry by entry without ``serialization_id``, DCP ``.distcp`` files item by item (each item's zip the same way),
``.metadata`` by its state-dict metadata and planner data (its ids and paths differ), ``.zckpt.json`` skipped.

    python benchmarks/compare_outputs.py OUT_A OUT_B
"""
import sys, os, zipfile, io, pickle, filecmp
def zip_items(data):
    z = zipfile.ZipFile(io.BytesIO(data))
    return {n.split("/",1)[1]: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}
def distcp_items(path, meta):
    import torch.distributed.checkpoint  # noqa: F401 - the classes .metadata names
    md = pickle.load(open(meta, "rb"))
    data = open(path, "rb").read()
    out = {}
    for idx, si in md.storage_data.items():
        if os.path.basename(path) == si.relative_path:
            out[(idx.fqn, tuple(idx.offset or ()))] = zip_items(data[si.offset: si.offset + si.length])
    return out, md
bad = 0
a, b = sys.argv[1], sys.argv[2]
for root, _, files in os.walk(a):
    for f in files:
        pa = os.path.join(root, f); pb = os.path.join(b, os.path.relpath(pa, a))
        if f == ".zckpt.json": continue
        if filecmp.cmp(pa, pb, shallow=False): continue
        if f == ".metadata":
            ma, mb = pickle.load(open(pa,"rb")), pickle.load(open(pb,"rb"))
            if ma.state_dict_metadata != mb.state_dict_metadata or ma.planner_data != mb.planner_data:
                print("DIFF metadata", pa); bad += 1
            continue
        if f.endswith(".distcp"):
            ia, _ = distcp_items(pa, os.path.join(root, ".metadata")); ib, _ = distcp_items(pb, os.path.join(os.path.dirname(pb), ".metadata"))
            if ia != ib: print("DIFF distcp", pa); bad += 1
            continue
        try:
            if zip_items(open(pa,"rb").read()) != zip_items(open(pb,"rb").read()): print("DIFF zip", pa); bad += 1
        except zipfile.BadZipFile:
            print("DIFF", pa); bad += 1
print(a, "identical apart from serialization ids, markers and DCP ids" if not bad else f"{bad} differences")
