from dashrun.memd.cli import main

main()
