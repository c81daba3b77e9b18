from zckpt.cli.main import main

main()
