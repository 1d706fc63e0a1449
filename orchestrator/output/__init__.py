"""From generated text to an API answer: the template family's output format (reasoning, tool calls), stream
parsing, stop strings, and gpt-oss harmony.

    formats.py  output formats by template family
    parsing.py  parse_output / make_stream_parser
    stops.py    stop strings across token boundaries
    harmony.py  the harmony format of gpt-oss
"""
