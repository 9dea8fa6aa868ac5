from cubeaccel.cli import main

main()
