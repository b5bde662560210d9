from hpref.cli import main

main()
