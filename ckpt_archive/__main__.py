from ckpt_archive.cli.app import main

main()
