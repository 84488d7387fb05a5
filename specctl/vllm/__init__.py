"""Everything specctl knows about vLLM, in one package.

support: whether vLLM can run a verifier here (imports vLLM, answer cached). defects: known vLLM
defects that change what an exported drafter computes. check: `specctl export --check`, vLLM's own
speculators parser. capabilities: what each vLLM version has (methods, fields, features), read
from package metadata without importing vLLM. The engine launchers and worker protocols move here
next (issue 46); until then they import these modules.
"""
