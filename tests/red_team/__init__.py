"""Red-team trials kept as parametrised cases: each row is a hostile or unlucky input tried once by hand, and
the behaviour promised for it (one line naming the flag or file, nothing on disk lost). The next round starts here."""
