"""The methods of the RABO family (rabo-paper.txt, Table II; SPEC 2), by name, for configs and engines.

The bilevel ones run `algorithms.rabo` (RABO, RAFBO, FedMBO = all masks full); the paper's single-level
sub-model baselines (Static, FedRolex, FIARSE, OAP) are taken here as RABO with their sub-model
extraction rule (`core.masks`), so they differ from RABO in the masks only. The full-model baselines are
FedAvg of a meta-learner or of the untuned classifier (`algorithms.fedmeta`).
"""

# method -> (rabo.method, rabo.mask_rule or None to keep the config's) for the bilevel family; the
# sub-model baselines are RABO with their extraction rule (`core.masks`)
BILEVEL = {"rabo": ("rabo", None), "rafbo": ("rafbo", None), "fedmbo": ("fedmbo", "full"),
           "static": ("rabo", "static"), "fedrolex": ("rabo", "rolling"), "fiarse": ("rabo", "magnitude"),
           "oap": ("rabo", "oap")}
# full-model FedAvg baselines: method -> its client step module (`algorithms.fedmeta`) and its task kind
FULL = {"dist-protonet": ("ciders.algorithms.dist_protonet", "fewshot"),
        "dist-maml": ("ciders.algorithms.dist_maml", "fewshot"),
        "fedavg": ("ciders.algorithms.fedavg_notune", "losstune")}
METHODS = (*BILEVEL, *FULL)
