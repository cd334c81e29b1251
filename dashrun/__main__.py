from dashrun.launch.cli import main

main()
