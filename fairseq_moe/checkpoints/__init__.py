"""A set of checkpoint files on disk, with no fairseq import: the format and reading (sets), the commit of a save
of many ranks (commit), checks of a checkpoint against the flags (fits), writing new files only (new_files), safe
loading (safe_load), and what every command shares (command: its runner, its one error convention)."""
