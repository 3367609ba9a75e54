#!/usr/bin/env python3
"""LauncherDeploy: checks deploy/'s files for engines this machine cannot run (docker, a
Kubernetes cluster, Slurm) as far as it can:

- docker-compose.yml and k8s/*.yaml parse as YAML (PyYAML), every image is the one the
  Dockerfile's documented build tags, and every command they run is a lorapipe executable that
  exists in BIN_DIR, given only flags that executable defines (its gflags --helpxml);
- the Dockerfile's instructions are known ones, its build step calls scripts/deps.sh functions
  that exist, and its entry point is a built executable;
- the Slurm files pass `bash -n`, and ranks.sh maps a Slurm task's environment to the RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT the trainer reads;
- every `lorapipe-*` command in deploy/README.md names real flags too.

    python tests/deploy_check.py SOURCE_DIR BIN_DIR
"""
import os
import re
import shlex
import subprocess
import sys

import yaml

SOURCE, BIN = sys.argv[1], sys.argv[2]
DEPLOY = os.path.join(SOURCE, "deploy")
IMAGE = "lorapipe:latest"
failures = []
checked = {"commands": 0, "flags": 0}
_flags = {}


def fail(message):
    failures.append(message)
    print("FAIL:", message)


def stage_flags(executable):
    """The flags `executable` defines, from its --helpxml (gflags' own included)."""
    if executable not in _flags:
        path = os.path.join(BIN, executable)
        if not os.access(path, os.X_OK):
            fail(f"{executable} is not a built executable in {BIN}")
            _flags[executable] = None
        else:
            xml = subprocess.run([path, "--helpxml"], capture_output=True, text=True).stdout
            _flags[executable] = set(re.findall(r"<name>([^<]+)</name>", xml))
            if len(_flags[executable]) < 5:
                fail(f"{executable} --helpxml listed no flags")
    return _flags[executable]


def check_command(where, argv):
    """argv: an executable and its arguments, as a container or a script runs them."""
    executable = os.path.basename(argv[0])
    if not executable.startswith("lorapipe"):
        fail(f"{where}: runs {argv[0]}, not a lorapipe executable")
        return
    known = stage_flags(executable)
    checked["commands"] += 1
    if known is None:
        return
    for arg in argv[1:]:
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0]
        checked["flags"] += 1
        if name not in known and not (name.startswith("no") and name[2:] in known):
            fail(f"{where}: {executable} has no flag --{name}")


def check_compose():
    path = os.path.join(DEPLOY, "docker-compose.yml")
    with open(path) as f:
        doc = yaml.safe_load(f)
    services = doc.get("services", {})
    for want in ("cacher", "preprocess", "trainer", "sampler"):
        if want not in services:
            fail(f"{path}: no {want} service")
    for name, service in services.items():
        if service.get("image") != IMAGE:
            fail(f"{path}: service {name} runs image {service.get('image')}, not {IMAGE}")
        check_command(f"{path}: {name}", list(service["entrypoint"]) + list(service["command"]))
        for dependency in service.get("depends_on", []):
            if dependency not in services:
                fail(f"{path}: {name} depends on unknown service {dependency}")
    gpus = {name: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name, s in services.items() if "deploy" in s}
    if gpus.get("trainer") != ["0"] or gpus.get("sampler") != ["1"]:
        fail(f"{path}: the trainer must have GPU 0 and the sampler GPU 1, got {gpus}")
    if "cache" not in doc.get("volumes", {}):
        fail(f"{path}: the cacher's cache is not a named volume")


def check_kubernetes():
    kinds = {}
    folder = os.path.join(DEPLOY, "k8s")
    for file in sorted(os.listdir(folder)):
        path = os.path.join(folder, file)
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
                spec = doc.get("spec", {})
                template = spec.get("template", {}).get("spec", {})
                for container in template.get("containers", []):
                    if container["image"] != IMAGE:
                        fail(f"{path}: {container['name']} runs {container['image']}")
                    check_command(f"{path}: {container['name']}",
                                  container["command"] + container.get("args", []))
                    env = {e["name"] for e in container.get("env", [])}
                    if doc["kind"] == "Job" and container["name"] == "trainer":
                        missing = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                   "MASTER_PORT"} - env
                        if missing:
                            fail(f"{path}: the trainer Job lacks {sorted(missing)}")
                        if spec.get("completionMode") != "Indexed":
                            fail(f"{path}: the trainer Job is not Indexed (RANK needs it)")
                if doc["kind"] == "StatefulSet" and not spec.get("volumeClaimTemplates"):
                    fail(f"{path}: the cacher StatefulSet has no volume for its cache")
    want = {"StatefulSet": "lorapipe-cacher", "Job": "lorapipe-trainer",
            "Deployment": "lorapipe-sampler"}
    for kind, name in want.items():
        if name not in kinds.get(kind, []):
            fail(f"deploy/k8s: no {kind} {name} (found {kinds})")


def check_dockerfile():
    path = os.path.join(DEPLOY, "Dockerfile")
    with open(path) as f:
        text = f.read()
    joined = re.sub(r"\\\n", " ", text)
    instructions = [line.split(None, 1) for line in joined.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    known = {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "VOLUME", "ENTRYPOINT", "CMD", "ARG"}
    for words in instructions:
        if words[0] not in known:
            fail(f"{path}: unknown instruction {words[0]}")
    if instructions[0][0] != "FROM":
        fail(f"{path}: does not start with FROM")
    with open(os.path.join(SOURCE, "scripts", "deps.sh")) as f:
        functions = set(re.findall(r"^(lorapipe_\w+)\(\)", f.read(), re.M))
    used = set(re.findall(r"\b(lorapipe_\w+)\b", joined))
    if not {"lorapipe_install_apt", "lorapipe_ensure_venv", "lorapipe_build"} <= used:
        fail(f"{path}: does not build with scripts/deps.sh's three steps (uses {sorted(used)})")
    for function in used - functions:
        fail(f"{path}: calls {function}, which scripts/deps.sh does not define")
    if f"-t {IMAGE}" not in text:
        fail(f"{path}: its documented build does not tag {IMAGE}")
    entry = [w for w in instructions if w[0] == "ENTRYPOINT"]
    if not entry or not os.access(os.path.join(BIN, eval(entry[0][1])[0]), os.X_OK):
        fail(f"{path}: the entry point is not a built executable")


def check_slurm():
    folder = os.path.join(DEPLOY, "slurm")
    for file in ("train.sbatch", "ranks.sh"):
        result = subprocess.run(["bash", "-n", os.path.join(folder, file)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            fail(f"deploy/slurm/{file}: bash -n: {result.stderr.strip()}")
    # Task 5 of 8, the second task on its node, job 4242, launched from 10.1.2.3.
    env = {"PATH": os.environ["PATH"], "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
           "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
    script = (f"source {shlex.quote(os.path.join(folder, 'ranks.sh'))} && "
              "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT")
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    have_scontrol = subprocess.run(["bash", "-c", "command -v scontrol"],
                                   capture_output=True).returncode == 0
    want_addr = "gpu07" if have_scontrol else "10.1.2.3"
    want = f"5 8 1 {want_addr} {20000 + 4242 % 20000}"
    if result.stdout.strip() != want:
        fail(f"deploy/slurm/ranks.sh gives '{result.stdout.strip()}' {result.stderr.strip()}, "
             f"want '{want}'")
    # Outside Slurm it stops with a message instead of starting rank-less trainers.
    result = subprocess.run(["bash", "-c", f"source {os.path.join(folder, 'ranks.sh')}"],
                            env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    if result.returncode == 0 or "Slurm" not in result.stderr:
        fail("deploy/slurm/ranks.sh outside Slurm: no clear error")
    with open(os.path.join(folder, "train.sbatch")) as f:
        text = f.read()
    if "ranks.sh" not in text or "lorapipe-trainer" not in text:
        fail("deploy/slurm/train.sbatch does not start the trainer through ranks.sh")
    flags = re.findall(r"--(\w+)=", text.split("set -euo pipefail", 1)[1])
    known = stage_flags("lorapipe-trainer") or set()
    for flag in flags:
        checked["flags"] += 1
        if flag not in known:
            fail(f"deploy/slurm/train.sbatch: lorapipe-trainer has no flag --{flag}")


def check_readme():
    path = os.path.join(DEPLOY, "README.md")
    with open(path) as f:
        text = f.read()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        block = re.sub(r"\\\n", " ", block)
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            words = shlex.split(line) if line else []
            starts = [i for i, w in enumerate(words) if re.fullmatch(r"lorapipe-\w+", w)]
            for i in starts:
                check_command(f"{path}: {line[:40]}...", words[i:])


for check in (check_compose, check_kubernetes, check_dockerfile, check_slurm, check_readme):
    try:
        check()
    except Exception as e:  # a file that does not even have the expected shape
        fail(f"{check.__name__}: {type(e).__name__}: {e}")
print(f"[deploy] {checked['commands']} commands and {checked['flags']} flags checked against "
      f"the built executables; {len(failures)} problems")
sys.exit(1 if failures else 0)
