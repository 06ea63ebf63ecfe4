from volutectl.cli import main

main()
