"""The background builder of ``scripts/setup`` (``runner``) and the status
file it keeps (``status``); the plan and the texts are ``core/builds.py``."""
