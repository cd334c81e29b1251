from dashrun.cli import main

main()
