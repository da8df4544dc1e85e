"""The ``gpuclusters`` command line: Typer commands over :mod:`gpuclusters.client`.

One module per resource group (``clusters``, ``nodes``, ``volumes``, ``org``),
plus ``context`` (client factory, shared options, error handling), ``render``
(tables and JSON) and ``progress`` (the live ``--wait`` display). The CLI
never imports the server; ``gpuclusters server`` loads it lazily at run time.

Output contract: with ``--output json`` stdout carries exactly the API objects
(``model_dump(mode="json")``, lists as arrays) and nothing else; progress,
hints and errors (``error [<code>]: <message>``, exit status 1) go to stderr.
"""
