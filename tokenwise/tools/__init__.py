"""Developer tools that ship with the package (run as `python -m tokenwise.tools.<name>`)."""
