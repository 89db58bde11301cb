"""Data files of the judge: exemplars, the labelled set, writing requests (see ``judge.styles``)."""
