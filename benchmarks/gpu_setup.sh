# Sourced by the GPU scripts (gpu_suite.sh, gpu_train_steps.sh): ROOT, PY (PYTHON, default
# python3), R (RESULTS, default benchmarks/results/gpu, made), the working directory ROOT,
# carried iproute2 (.ipr) first on PATH, Fashion-MNIST copied from FASHION_MNIST into the
# folder the training CLI reads by default, and the device and torch written to R/device.txt.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
R=${RESULTS:-$ROOT/benchmarks/results/gpu}
DATA=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
mkdir -p "$R"
cd "$ROOT"
[ -d "$ROOT/.ipr" ] && export PATH="$ROOT/.ipr:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$DATA" != /usr/share/datasets/fashion-mnist ]; then
    mkdir -p /usr/share/datasets/fashion-mnist && cp "$DATA"/*.gz /usr/share/datasets/fashion-mnist/
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$R/device.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee -a "$R/device.txt"
