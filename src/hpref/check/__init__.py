"""`hpref recipes check`: a recipe checked as the command it is for would check it."""
