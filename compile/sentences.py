"""Real text, one-word queries to long passages, on which a reduced-precision artifact's outputs are
compared with the fp32 model's at compile time (the tests check served outputs on others). The
one- and two-word inputs are where quantization loses most: a pooled embedding of three or four
tokens has nothing to average its rounding errors over."""

ACCURACY_SENTENCES = [
    "no",
    "yes",
    "hello",
    "Paris",
    "thank you",
    "cheap flights",
    "python tutorial",
    "weather tomorrow",
    "how to reset a router",
    "best pizza near me",
    "What is the capital of Australia?",
    "symptoms of vitamin D deficiency",
    "The meeting has been moved to Thursday afternoon.",
    "A man is playing a guitar on stage while the crowd sings along.",
    "Can I return a gift without the receipt?",
    "The committee approved the budget after a long and heated debate.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Our flight was delayed for three hours because of fog at the airport.",
    "He apologised for the misunderstanding and offered to pay for the repairs.",
    "The museum's new wing displays sculptures from the early twentieth century.",
    "Interest rates are expected to stay unchanged until the end of the year.",
    "She trained for months before running her first marathon in under four hours.",
    "The recipe calls for two cups of flour, a pinch of salt and three eggs.",
    "Researchers found that regular sleep improves memory consolidation in adults.",
    "Please make sure all electronic devices are switched off during the examination.",
    "The software update fixes a bug that caused the application to crash on start-up.",
    "Rain is forecast for the weekend, so the outdoor concert may be postponed.",
    "The children built a sandcastle and decorated it with shells and seaweed.",
    "Volcanic eruptions can inject sulfur dioxide into the stratosphere and cool the climate "
    "for several years, as happened after Mount Pinatubo erupted in 1991.",
    "The court ruled that the contract was void because one of the parties had not been "
    "informed of the risks, and ordered the company to refund every customer in full.",
    "When the bridge was finally reopened after eighteen months of repairs, commuters "
    "celebrated the end of the long detours that had doubled their travel times.",
    "Machine translation systems have improved dramatically, yet they still struggle with "
    "idioms, rare languages and documents that require knowledge of the wider context.",
    "The library extended its opening hours during the exam period, and students filled "
    "every desk from early morning until midnight, many of them bringing their own lamps.",
    "Although the team lost the final, the coach praised the players for their discipline, "
    "their resilience after conceding early, and the way they kept attacking until the end.",
    "Honey never spoils: archaeologists have found pots of it in ancient Egyptian tombs "
    "that were still perfectly edible after thousands of years.",
    "The startup raised forty million dollars to build batteries that charge in minutes, "
    "promising electric cars that refuel about as quickly as petrol ones.",
    "To apply for the scholarship, send a short essay describing your research interests, "
    "two letters of recommendation and a copy of your most recent transcript before March.",
    "In the old town, narrow cobbled streets wind between houses painted in bright colours, "
    "and small cafés spill onto the squares where musicians play on summer evenings. "
    "Tourists come for the architecture, but many stay for the food: fresh fish from the "
    "harbour, bread baked in wood-fired ovens, and wine from the hills that surround the city.",
    "The report concludes that the city's water supply is adequate for current demand, but "
    "warns that population growth and longer droughts could cause shortages within a decade "
    "unless leaks in the ageing pipe network are repaired and new reservoirs are built. It "
    "recommends a phased investment plan, financed partly by a modest increase in tariffs.",
    "A transformer encoder maps each token of a sentence to a vector that depends on every "
    "other token, through layers of self-attention and feed-forward networks; pooling those "
    "vectors gives one embedding per sentence, which search engines compare by cosine "
    "similarity to find passages that answer a query even when they share no words with it.",
]
