"""The output processor: tokens -> text, stop strings, the reasoning split, tool calls parsed
(one parser per family), JSON values and schema grammars."""
