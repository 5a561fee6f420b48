from megarl.cli.convert import main

if __name__ == "__main__":
    main()
