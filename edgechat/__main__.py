from edgechat.cli import main

main()
