from dashrun.agent.cli import main

main()
