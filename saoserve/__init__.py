"""The saoserve command line and the jobs it starts (see ``saoserve --help``)."""
