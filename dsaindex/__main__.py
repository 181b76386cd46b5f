from dsaindex.cli import main

main()
