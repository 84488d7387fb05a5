"""The speculators format on disk -- the directory vLLM loads as a drafter -- in one package that
every stage uses and that imports no stage: export writes it, bench and hub read it, the vLLM
check parses it, a training checkpoint builds its drafter through its typed config.

- `config`: config.json, typed (`SpeculatorsConfig` and each algorithm's fields).
- `validate`: is a directory a loadable export (`validate_export` -> `ExportDir`), its tensors read.
- `io`: a drafter's files written (`drafter_files(...).write`), a directory read back as files
  (`read_files`) or as a drafter (`load_drafter`).

This file imports none of them: `specctl.drafters` imports `config`, and `validate` imports the
drafter registry, so a package that loaded its modules eagerly would import itself in a circle.
"""
