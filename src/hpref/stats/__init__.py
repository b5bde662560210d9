"""`hpref data stats`: a data file's or a recipe dataset's statistics (`counts`), and the command
that builds a recipe's parts for them (`command`)."""
