import sys, json
sys.path.insert(0, ".")
import dist_helpers
if __name__ == "__main__":
    from moe_exp.distributed import launch, rank_entry
    ov = json.loads(sys.argv[2]); n = int(sys.argv[1])
    r = launch(rank_entry, n, dist_helpers.tp_grads_match, ov, 2)
    w = max(r["grad_diffs"].items(), key=lambda kv: kv[1])
    print("loss", r["loss"], r["ref_loss"], "worst", w, len(r["grad_diffs"]))
