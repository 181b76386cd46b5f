#!/usr/bin/env bash
# background: store, a 7-CPU Ray head, three drivers at once (1, 2, 4 workers), comparison; W/DONE at the end
W=$1
export RAY_AUTH_MODE=disabled
mkdir -p $W
cd "$(dirname "$0")/.."
date +%s > $W/START
python3 tools/ray_scale.py build $W > $W/build.log 2>&1 || { echo build failed > $W/DONE; exit 1; }
date +%s > $W/BUILT
python3 -m ray.scripts.scripts start --head --node-ip-address 127.0.0.1 --port 6399 --num-cpus 7 --num-gpus 0 --include-dashboard=false \
    --disable-usage-stats > $W/raystart.log 2>&1 || { echo ray start failed > $W/DONE; exit 1; }
for k in 1 2 4; do python3 tools/ray_scale.py drive $W 127.0.0.1:6399 $k > $W/drive$k.out 2>&1 & done
wait
python3 tools/ray_scale.py compare $W > $W/compare.out 2>&1
python3 -m ray.scripts.scripts stop > /dev/null 2>&1
date +%s > $W/DONE
